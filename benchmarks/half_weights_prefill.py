"""Prefill linears over 16-bit weights under fp32 compute (a CPU without bf16 arithmetic): widening a few MB of the
weight at a time (quant/dense_layout.chunked_linear, what the engine does) against fp32 weights held whole (twice
the bytes: plain for torch's GEMM, or packed for oneDNN, the old `auto` path). One decoder layer of the 1B-shaped
model (benchmarks/peers/model_1b.py: q/k/v fused 3072x2048, o 2048x2048, gate/up fused 16384x2048, down
2048x8192), the variants interleaved, best of `--repeats`; prints one JSON object (prompt tok/s of the linears
alone, the whole layer stack: x num_layers). Random values: only speed is measured.

    python benchmarks/half_weights_prefill.py
    python benchmarks/half_weights_prefill.py --tokens 512 2048 --slices-mib 4 16 64 --conditions quiet
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402

from pagedserve.engine.host.allocator import keep_freed_memory  # noqa: E402
from pagedserve.kernels.cpu import isa  # noqa: E402
from pagedserve.quant import dense_layout  # noqa: E402
from pagedserve.quant.onednn_dense import can_pack, pack_weight, packed_linear  # noqa: E402

SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))  # (out, in) of one layer's linears
NUM_LAYERS = 16


def _variants(weights: list[torch.Tensor], slices_mib: list[int]) -> dict:
    plain = [w.float() for w in weights]
    out = {"fp32 plain (F.linear)": lambda xs: [F.linear(x, w) for x, w in zip(xs, plain)]}
    if can_pack(plain[0]):
        packed = [pack_weight(w) for w in plain]
        out["fp32 packed (oneDNN)"] = lambda xs: [packed_linear(x, p, None) for x, p in zip(xs, packed)]

    def widened(mib: int):
        def run(xs):
            dense_layout._WIDEN_CHUNK_BYTES = mib << 20
            return [dense_layout.chunked_linear(x, w, None) for x, w in zip(xs, weights)]
        return run
    for mib in slices_mib:
        out[f"bf16 widened, {mib} MiB slices"] = widened(mib)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--slices-mib", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--conditions", default="unstated")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the engine does: a slice's temporary reuses the last one's pages
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(o, i, generator=gen) * 0.02).bfloat16() for o, i in SHAPES]
    variants = _variants(weights, args.slices_mib)
    default_slice = dense_layout._WIDEN_CHUNK_BYTES
    results = {}
    with torch.inference_mode():
        for tokens in args.tokens:
            xs = [torch.randn(tokens, i, generator=gen) for _, i in SHAPES]
            best = {name: float("inf") for name in variants}
            for rep in range(args.repeats):
                names = list(variants)
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    t0 = time.perf_counter()
                    variants[name](xs)
                    best[name] = min(best[name], time.perf_counter() - t0)
            results[str(tokens)] = {name: round(tokens / (s * NUM_LAYERS), 1) for name, s in best.items()}
    dense_layout._WIDEN_CHUNK_BYTES = default_slice
    forced = isa.requested_tier()
    print(json.dumps({"benchmark": "half_weights_prefill", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "cpu": cpu_model(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "tier": forced.name if forced else f"native ({isa.host_tier()})", "threads": args.threads,
                      "conditions": args.conditions, "shapes": SHAPES, "num_layers": NUM_LAYERS,
                      "engine_slice_mib": default_slice >> 20,
                      "prompt_tok_s_linears_only": results}, indent=1))


if __name__ == "__main__":
    main()
