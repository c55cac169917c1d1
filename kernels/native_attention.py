"""The CPU serving path of the PagedAttention entry point: two native calls per layer and step.

Every decode row of a step goes through kernels/cpu/decode_attention.c and short prefill chunks through
kernels/cpu/prefill_attention.c; both read K/V blocks in place instead of gathering and upcasting them. Long chunks
(and every chunk when the head dim is not a multiple of 16) go to the shared SDPA path (prefill_attention.py), except
that for bf16 queries where the prefill kernel runs bf16 products (AMX tiles, kernels/cpu/prefill_amx.c, or
vdpbf16ps, prefill_dpbf16.c) every long chunk takes the kernel: over a bf16 cache it reads the blocks in place, over
an 8-bit one the chunks' blocks dequantized once into bf16 (cpu/prefill.py). SDPA stays for other query dtypes, on
builds without AVX512-BF16, and for head dims that are not a multiple of 16 (64 for AMX tiles). `auto` picks this
on CPU whenever the C files build here, and falls back to pure torch (logging why) when they cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.attention import AttentionImpl, AttentionMetadata, AttentionPlan
from pagedserve.kernels.cpu.native import (COMPUTE_DTYPES, DecodeBatch, decode_attention, gather_kv_8bit, load_library,
                                          write_kv, write_kv_fp8, write_kv_int8)
from pagedserve.kernels.cpu.prefill import (LongPrefill, PrefillBatch, bf16_long_prefill, long_prefill_native,
                                            prefill_attention_native)
from pagedserve.kernels.kv_cache import LayerKVCache
from pagedserve.kernels.kv_quant import gather_kv, store_kv
from pagedserve.kernels.prefill_attention import PrefillChunk, prefill_attention, prefill_chunks
from pagedserve.kernels.requirements import Requirements


@dataclass(frozen=True, slots=True)
class NativePlan(AttentionPlan):
    decode: DecodeBatch | None  # None when no sequence decodes this step
    prefill: PrefillBatch | None  # None when no sequence prefills, or head_dim is not a multiple of 16
    prefill_sdpa: tuple[PrefillChunk, ...]  # the chunks of such head dims, and long ones SDPA takes for every query
    # Long chunks where the kernel runs bf16 products: for bf16 queries, and again for SDPA (other query dtypes).
    prefill_long: tuple[LongPrefill, ...] = ()
    prefill_long_sdpa: tuple[PrefillChunk, ...] = ()


def _decode_batch(meta: AttentionMetadata, starts: list[int], window: int | None) -> DecodeBatch | None:
    decode = [i for i, q_len in enumerate(meta.query_lens_host) if q_len == 1]
    if not decode:
        return None
    if len(decode) == meta.num_seqs:  # the common decode-only step: no copies
        seq_lens, tables = meta.seq_lens, meta.block_tables
    else:
        index = torch.tensor(decode, dtype=torch.long)
        seq_lens, tables = meta.seq_lens[index], meta.block_tables[index]
    return DecodeBatch(
        rows=torch.tensor([starts[i] for i in decode], dtype=torch.long),
        seq_lens=seq_lens.contiguous(),
        block_tables=tables.contiguous(),
        max_seq_len=max(meta.seq_lens_host[i] for i in decode),
        window=window,
    )


def _sdpa_wins(meta: AttentionMetadata, i: int, min_work: int) -> bool:
    """Long chunks go to SDPA: torch's flash kernel tiles large products better than the C kernel's 16 x 16 tiles,
    and from about 256 x 256 it wins for every cache dtype, even after gathering and upcasting the blocks (bf16,
    2 threads: 1,024 tokens 26 ms vs 71 ms; a 2,911-token chunked prefill's second chunk 137 ms vs 274 ms; FP8, whose
    K tiles the C kernel widens lane by lane, 21 ms vs 114 ms and 121 ms vs 480 ms). Short chunks, where SDPA's
    per-chunk dispatch dominates, stay native (16 sequences of 32 tokens: 3.3 ms vs 7.8 ms). Measured before the bf16
    kernel had AMX tiles; where it has them it takes every long chunk of bf16 queries (prefill_amx.c: 1.5x SDPA from
    position 0 at 2,048 tokens, 2x after 2,048 cached ones, every cache dtype; benchmarks/prefill_attention_ab.py),
    and so does its vdpbf16ps loop (cpu/prefill.py's bf16_long_prefill)."""
    return meta.query_lens_host[i] * meta.seq_lens_host[i] >= min_work


_SDPA_MIN_WORK = 1 << 17  # queries x keys of one chunk: e.g. 362 x 362, 128 new tokens over 1,024


def _sdpa_min_work(cache: LayerKVCache) -> int:
    """The chunk size from which SDPA takes a prefill chunk. _SDPA_MIN_WORK was measured on AVX-512 builds; without
    AVX-512 (an AVX2 Zen 3, the portable build) the C kernel's tiles run at half width or less, and torch's SDPA wins
    from far smaller chunks: from 64 x 64 queries x keys over a 16-bit cache and from 8 new tokens over 1,024 over an
    8-bit one, which SDPA gathers and upcasts first. Rechecked with the AVX2 build's ymm passes (forced AVX2 tier,
    torch and oneDNN held to AVX2, 2 threads, ms per layer call, kernel / SDPA): bf16 16 prompts of 64 tokens 2.88 /
    2.95 and 4 chunks of 4 over 1,024 1.35 / 1.60 (4,096: level or the kernel ahead), 4 chunks of 8 over 1,024 2.40 /
    1.88 (8,192), 9 x 224 tokens 17.8 / 9.2; int8 4 chunks of 4 over 1,024 1.97 / 2.79, of 8 3.24 / 3.20, 9 x 96
    tokens 4.34 / 3.77 (benchmarks/prefill_attention_ab.py --threads 2; docs/kv-cache-formats.md)."""
    if load_library().pagedserve_isa_tier().startswith(b"avx512"):
        return _SDPA_MIN_WORK
    return _SDPA_MIN_WORK_NARROW_8BIT if cache.dtype.is_8bit else _SDPA_MIN_WORK_NARROW


_SDPA_MIN_WORK_NARROW = 1 << 12  # builds without AVX-512, a 16-bit or fp32 cache: e.g. 64 x 64
_SDPA_MIN_WORK_NARROW_8BIT = 1 << 13  # and an 8-bit cache: e.g. 8 new tokens over 1,024


def _heads_dense(*rows: torch.Tensor) -> bool:
    return all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in rows)


class NativeCpuAttention(AttentionImpl[NativePlan]):
    requirements = Requirements(cpu_only=True)

    def __init__(self) -> None:
        load_library()  # asked for by name, a missing compiler is an error here, not a silent fallback

    def plan(self, meta: AttentionMetadata, cache: LayerKVCache, window: int | None = None) -> NativePlan:
        starts = meta.query_starts()
        decode = _decode_batch(meta, starts, window)
        chunks = [i for i, q_len in enumerate(meta.query_lens_host) if q_len > 1]
        min_work = _sdpa_min_work(cache) if chunks else 0
        sdpa = tuple(i for i in chunks if cache.k.shape[3] % 16 or _sdpa_wins(meta, i, min_work))
        native = tuple(i for i in chunks if i not in sdpa)
        kernel, sdpa = (sdpa, ()) if sdpa and bf16_long_prefill(cache) else ((), sdpa)
        # The query dtype is the layer's to know: those long chunks both ways, and the attention call picks one.
        long = LongPrefill.of(cache, PrefillBatch.of(meta, starts, window, kernel)) if kernel else ()
        return NativePlan(window, decode, PrefillBatch.of(meta, starts, window, native),
                          prefill_chunks(meta, cache, starts, window, sdpa) if sdpa else (), long,
                          prefill_chunks(meta, cache, starts, window, kernel) if kernel else ())

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        k_storage = LayerKVCache.by_head(cache.k)
        if cache.dtype.has_row_scales and key.dtype in COMPUTE_DTYPES and _heads_dense(key, value):
            write_kv_int8(key, value, cache, slot_mapping)
        elif cache.dtype.is_fp8 and key.dtype in COMPUTE_DTYPES and _heads_dense(key, value):
            write_kv_fp8(key, value, cache, slot_mapping)
        elif cache.dtype.is_8bit or key.dtype != k_storage.dtype \
                or not _heads_dense(key, value):
            store_kv(key, value, cache, slot_mapping)  # quantizes or converts
        else:
            write_kv(key, value, k_storage, LayerKVCache.by_head(cache.v), slot_mapping)

    def attention(
        self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, plan: NativePlan, scale: float
    ) -> torch.Tensor:
        assert query.device.type == "cpu", "the native attention runs on CPU tensors only"
        if not _heads_dense(query):
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype)
        if plan.decode is not None:
            decode_attention(query, out, cache, plan.decode, scale)
        sdpa = plan.prefill_sdpa
        if plan.prefill is not None:
            prefill_attention_native(query, out, cache, plan.prefill, scale)
        if plan.prefill_long and query.dtype == torch.bfloat16:
            for part in plan.prefill_long:
                long_prefill_native(query, out, cache, part, scale)
        else:
            sdpa += plan.prefill_long_sdpa
        # 8-bit tiles dequantized in one native pass (torch's five passes were most of the 8-bit prefill's extra time)
        eight_bit = cache.dtype.is_8bit and cache.k.shape[3] % 16 == 0
        for chunk in sdpa:
            prefill_attention(query, out, cache, scale, chunk, gather_kv_8bit if eight_bit else gather_kv)
        return out
