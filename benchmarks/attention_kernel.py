"""Decode-attention kernel timing: achieved memory bandwidth of the Triton kernel on a GPU, the torch path on CPU.

Decode attention reads every cached K/V byte of every sequence once per step, so its roofline is memory
bandwidth: achieved GB/s = (K + V bytes of all contexts + query/output/table bytes) / kernel time.

    python benchmarks/attention_kernel.py                 # CUDA if present (Triton + torch path), else CPU torch path
    python benchmarks/attention_kernel.py --device cpu --batch 1 8 --context 512 2048 --json out.json

Run it from the repository root or anywhere; it imports pagedserve only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype
from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.kernels.backends import ATTENTION_IMPLS
from pagedserve.kernels.paged_attention import paged_attention, write_kv


@dataclass(frozen=True, slots=True)
class Case:
    impl: str
    device: str
    kv_dtype: str
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


@dataclass(frozen=True, slots=True)
class Result:
    case: Case
    median_ms: float
    bytes_moved: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / (self.median_ms * 1e-3) / 1e9


def build(case: Case, query_dtype: torch.dtype):
    """A decode batch: `batch` sequences of `context` tokens, blocks shuffled across the pool."""
    device = torch.device(case.device)
    kv_dtype = KVDtype(case.kv_dtype)
    per_seq = -(-case.context // case.block_size)
    cache = KVCache(KVCacheSpec(1, case.num_kv_heads, case.head_dim, case.block_size, kv_dtype), case.batch * per_seq, device)
    layer = cache.layers[0]
    if kv_dtype.is_fp8:
        cache.set_scales(0, torch.full((case.num_kv_heads,), 0.01), torch.full((case.num_kv_heads,), 0.01))
    tables = torch.randperm(case.batch * per_seq, device=device).view(case.batch, per_seq).int()
    writer = ATTENTION_IMPLS.get("torch")()
    for seq in range(case.batch):  # one sequence at a time keeps the temporary K/V small
        pos = torch.arange(case.context, device=device)
        slots = tables[seq, pos // case.block_size].long() * case.block_size + pos % case.block_size
        kv = torch.randn(2, case.context, case.num_kv_heads, case.head_dim, device=device, dtype=query_dtype)
        write_kv(writer, kv[0], kv[1], layer, slots)
    lens = torch.full((case.batch,), case.context, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(case.batch + 1, dtype=torch.int32, device=device),
        seq_lens=lens, block_tables=tables,
        slot_mapping=tables[:, -1].long() * case.block_size + (case.context - 1) % case.block_size,
        max_query_len=1, max_seq_len=case.context,
        query_lens_host=(1,) * case.batch, seq_lens_host=(case.context,) * case.batch,
    )
    query = torch.randn(case.batch, case.num_heads, case.head_dim, device=device, dtype=query_dtype)
    return query, layer, meta


def bytes_moved(case: Case, query: torch.Tensor, meta: AttentionMetadata) -> int:
    """Bytes a decode step must move: every K/V row (int8 rows with their fp16 scale), queries, outputs, tables."""
    kv_dtype = KVDtype(case.kv_dtype)
    kv = 2 * case.batch * case.context * case.num_kv_heads * (case.head_dim * kv_dtype.itemsize + kv_dtype.row_bytes_extra)
    return kv + 2 * query.numel() * query.element_size() + meta.block_tables.numel() * 4


def time_case(case: Case, iters: int, query_dtype: torch.dtype) -> Result:
    query, layer, meta = build(case, query_dtype)
    impl = ATTENTION_IMPLS.get(case.impl)()
    scale = case.head_dim**-0.5
    plan = impl.plan(meta, layer)  # once per step in the engine, shared by every layer: not part of a layer's time
    run = lambda: paged_attention(impl, query, layer, meta, scale, plan)  # noqa: E731
    for _ in range(3):
        run()
    samples = []
    if case.device == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            run()
            samples.append((time.perf_counter() - t0) * 1e3)
    return Result(case, statistics.median(samples), bytes_moved(case, query, meta))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--context", type=int, nargs="+", default=None)
    parser.add_argument("--kv-dtype", nargs="+", default=None, help="fp16 bf16 fp8_e4m3 fp8_e5m2 fp32")
    parser.add_argument("--num-heads", type=int, default=None)
    parser.add_argument("--num-kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    gpu = device == "cuda"
    # GPU default: a Llama-3-8B layer (32 heads, 8 KV heads, d=128). CPU default: SmolLM2-135M (9 / 3, d=64).
    heads = args.num_heads or (32 if gpu else 9)
    kv_heads = args.num_kv_heads or (8 if gpu else 3)
    head_dim = args.head_dim or (128 if gpu else 64)
    batches = args.batch or ([1, 16, 64, 256] if gpu else [1, 8, 32])
    contexts = args.context or ([1024, 4096, 16384] if gpu else [512, 2048])
    dtypes = args.kv_dtype or (["fp16", "fp8_e4m3", "fp8_e5m2"] if gpu else ["fp32", "fp8_e4m3"])
    impls = ["triton", "torch"] if gpu else ["torch"]
    query_dtype = torch.float16 if gpu else torch.float32
    iters = args.iters or (50 if gpu else 10)
    if gpu:
        print(f"device: {torch.cuda.get_device_name()}")
    else:
        print(f"device: CPU, {torch.get_num_threads()} threads")
    print(f"{'impl':7} {'kv':9} {'batch':>5} {'context':>7} {'ms':>9} {'GB/s':>8}")
    results = []
    for impl in impls:
        for kv_dtype in dtypes:
            for batch in batches:
                for context in contexts:
                    case = Case(impl, device, kv_dtype, batch, context, heads, kv_heads, head_dim, args.block_size)
                    try:
                        result = time_case(case, iters, query_dtype)
                    except Exception as exc:  # OOM, an unsupported dtype on this GPU, ...: report, go on
                        print(f"{impl:7} {kv_dtype:9} {batch:5} {context:7}  skipped: {str(exc).splitlines()[0][:80]}")
                        continue
                    results.append(result)
                    print(f"{impl:7} {kv_dtype:9} {batch:5} {context:7} {result.median_ms:9.3f} {result.gb_per_s:8.1f}")
                    if gpu:
                        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r.case), "median_ms": r.median_ms, "gb_per_s": r.gb_per_s} for r in results], f, indent=1)


if __name__ == "__main__":
    main()
