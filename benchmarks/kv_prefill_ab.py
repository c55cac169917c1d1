"""One layer of a long prefill chunk over each cache dtype, the native path's 8-bit pieces against the torch code they
replaced, alternated in one process (never in CI).

A layer's prefill work that depends on the cache dtype, on SmolLM2-135M's shapes (9 query heads, 3 KV heads, head
dim 64, Hadamard-rotated K as 8-bit caches store it): the KV write of `--new` tokens and the attention of those
tokens over `--context` keys (the path the native backend picks: where AMX is granted, the bf16 kernel, over the
gathered blocks for an 8-bit cache, else SDPA over them), through the entry points. `torch` swaps in what the
native path ran before: the torch gather and dequantize (kv_quant.gather_kv), the torch FP8 write
(kv_quant.store_kv) and the rotation as a 3-D matmul; `native` is this tree. A and B alternate `--pairs` times;
prints one JSON object per cache dtype: median ms per layer of each, and torch / native.

    python benchmarks/kv_prefill_ab.py --context 4096 --new 2048 --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
from fp8_kv_accuracy import host_info  # noqa: E402
from pagedserve.kernels import native_attention, paged_attention as entry  # noqa: E402
from pagedserve.kernels.cpu import prefill as cpu_prefill  # noqa: E402
from pagedserve.kernels.attention import AttentionMetadata  # noqa: E402
from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype  # noqa: E402
from pagedserve.kernels.kv_quant import gather_kv, store_kv  # noqa: E402
from pagedserve.kernels.kv_scales import hadamard  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
NATIVE = (native_attention.gather_kv_8bit, native_attention.write_kv_fp8, entry.rotate)
TORCH = (lambda cache, tiles, dtype: gather_kv(cache, tiles, dtype), store_kv,
         lambda x, rotation: x @ rotation.to(x.dtype))


def use(pieces: tuple) -> None:
    native_attention.gather_kv_8bit, native_attention.write_kv_fp8, entry.rotate = pieces
    cpu_prefill.gather_kv_8bit = pieces[0]  # the long chunks' gather before the AMX kernel


def layer_case(kv: str, context: int, new: int) -> tuple:
    dtype = KVDtype.parse(kv, torch.bfloat16)
    blocks = -(-context // BLOCK)
    cache = KVCache(KVCacheSpec(1, KV_HEADS, DIM, BLOCK, dtype), blocks + 1)
    if dtype.is_8bit:
        cache.set_k_rotation(hadamard(DIM))
    layer = cache.layers[0]
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(context, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(torch.bfloat16)
    split = qkv.view(context, HEADS + 2 * KV_HEADS, DIM)
    q, k, v = split[:, :HEADS], split[:, HEADS : HEADS + KV_HEADS], split[:, HEADS + KV_HEADS :]
    table = torch.randperm(blocks + 1, generator=gen)[:blocks].to(torch.int32)
    slots = (table.long()[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:context]
    impl = native_attention.NativeCpuAttention()
    entry.write_kv(impl, k[: context - new], v[: context - new], layer, slots[: context - new])
    meta = AttentionMetadata(
        seq_lens=torch.tensor([context], dtype=torch.int32), query_start_loc=torch.tensor([0, new], dtype=torch.int32),
        block_tables=table[None].contiguous(), slot_mapping=slots[context - new :].contiguous(), max_query_len=new,
        max_seq_len=context, seq_lens_host=(context,), query_lens_host=(new,))
    return impl, layer, meta, q[context - new :], k[context - new :], v[context - new :]


def time_layer(case: tuple) -> float:
    impl, layer, meta, q, k, v = case
    t0 = time.perf_counter()
    entry.write_kv(impl, k, v, layer, meta.slot_mapping)
    entry.paged_attention(impl, q, layer, meta, DIM**-0.5)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv", nargs="+", default=["bf16", "int8", "fp8_e4m3"])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--new", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per side and pair (median kept)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    for kv in args.kv:
        case = layer_case(kv, args.context, args.new)
        times: dict[str, list[float]] = {"torch": [], "native": []}
        for _ in range(args.pairs):
            for name, pieces in (("torch", TORCH), ("native", NATIVE)):
                use(pieces)
                times[name].append(statistics.median(time_layer(case) for _ in range(args.calls)))
        use(NATIVE)
        a, b = statistics.median(times["torch"]), statistics.median(times["native"])
        print(json.dumps({"kv": kv, "context": args.context, "new": args.new, "torch_ms": a, "native_ms": b,
                          "torch_over_native": a / b, "pairs": times, "threads": torch.get_num_threads(),
                          "load_before": load, "load_after": os.getloadavg()[0], **host_info()}), flush=True)


if __name__ == "__main__":
    main()
