"""Prefill chunks through the native kernel (prefill_attention.c): every sequence of a step with more than one
new token, in one call per layer, reading K/V blocks in place.

The torch path (prefill_attention.py) gathers and upcasts each chunk's blocks and runs SDPA once per sequence and
layer; the native kernel replaces both with one parallel region over (sequence, KV head, 16 query positions).
Head dims that are not a multiple of 16 keep the SDPA path (NativeCpuAttention.plan decides), and so do long chunks
unless the kernel runs bf16 products here (`bf16_long_prefill`: AMX tiles, or vdpbf16ps); then long chunks over an
8-bit cache read their blocks dequantized once per layer into contiguous bf16 (`LongPrefill`), not tile by tile in
each task.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedserve.kernels.attention import AttentionMetadata, first_visible_key
from pagedserve.kernels.cpu.native import attention_fields, gather_kv_8bit, load_library
from pagedserve.kernels.cpu.structs import PrefillArgs
from pagedserve.kernels.kv_cache import KVDtype, LayerKVCache
from pagedserve.kernels.kv_quant import head_tiles


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """The prefill chunks of one step, as the native kernel reads them. Built once per step, shared by all layers."""

    rows: torch.Tensor  # [S] int64: each chunk's first query row
    query_lens: torch.Tensor  # [S] int32: new tokens (> 1)
    seq_lens: torch.Tensor  # [S] int32: context length including the new tokens
    block_tables: torch.Tensor  # [S, B] int32, contiguous; entries before the window may be -1 (freed)
    window: int | None = None

    def __post_init__(self) -> None:
        n = self.rows.shape[0]
        assert self.rows.dtype == torch.int64 and self.query_lens.dtype == self.seq_lens.dtype == torch.int32
        assert self.query_lens.shape == self.seq_lens.shape == (n,) and self.block_tables.shape[0] == n
        assert self.block_tables.dtype == torch.int32 and self.block_tables.is_contiguous()
        assert self.window is None or self.window >= 1

    @classmethod
    def of(cls, meta: AttentionMetadata, starts: list[int], window: int | None,
           picked: tuple[int, ...]) -> PrefillBatch | None:
        """The step's chunks this kernel computes (`picked`: indices of sequences with more than one new token), or
        None when there are none."""
        if not picked:
            return None
        index = torch.tensor(picked, dtype=torch.long)
        return cls(
            rows=torch.tensor([starts[i] for i in picked], dtype=torch.long),
            query_lens=torch.tensor([meta.query_lens_host[i] for i in picked], dtype=torch.int32),
            seq_lens=meta.seq_lens[index].contiguous(),
            block_tables=meta.block_tables[index].contiguous(),
            window=window,
        )


def amx_prefill(cache: LayerKVCache) -> bool:
    """Whether long chunks of bf16 queries over this cache take the kernel's AMX tiles here (then all of them do:
    native_attention.NativeCpuAttention.plan): a bf16 or 8-bit cache, a head dim that is a multiple of 64, a build
    with AMX and the OS's grant of the tile state. An 8-bit cache's K tiles dequantized in each task (once per 16
    query positions) cost the kernel 10-20% on chunks of 1,000 tokens and more; dequantized once per chunk and
    layer (`LongPrefill`), it runs at the bf16 cache's speed plus the gather (benchmarks/prefill_attention_ab.py)."""
    return _bf16_keys(cache) and load_library().pagedserve_prefill_amx(cache.k.shape[3]) == 1


def dpbf16_prefill(cache: LayerKVCache) -> bool:
    """Whether bf16 queries over this cache take the kernel's vdpbf16ps loop (prefill_dpbf16.c) rather than AMX
    tiles: an AVX512-BF16 build (a Zen 4, an SPR VM that refuses the tile state, or the forced avx512_bf16 tier) over
    a bf16 or 8-bit cache, a head dim that is a multiple of 16."""
    return (_bf16_keys(cache) and cache.k.shape[3] % 16 == 0
            and load_library().pagedserve_isa_tier() == b"avx512_bf16" and not amx_prefill(cache))


def bf16_long_prefill(cache: LayerKVCache) -> bool:
    """Whether long chunks of bf16 queries take the kernel rather than SDPA (then all of them do:
    native_attention.NativeCpuAttention.plan): on AMX tiles, and on vdpbf16ps too, where torch's SDPA has no AMX
    either and runs 2.0-4.5x the kernel's time at every chunk size measured, 1,024 to 2,048 new tokens over 4,096
    included (a Zen 4, 1 and 2 threads, every cache dtype; benchmarks/prefill_attention_ab.py)."""
    return amx_prefill(cache) or dpbf16_prefill(cache)


def _bf16_keys(cache: LayerKVCache) -> bool:
    """Keys the bf16 kernel reads as bf16: a bf16 cache in place, an 8-bit one widened (prefill_bf16.h)."""
    return cache.k.dtype == torch.bfloat16 or cache.dtype.is_8bit


@dataclass(frozen=True, slots=True)
class LongPrefill:
    """Long chunks of a step for the bf16 kernel. Over a bf16 cache it reads the blocks in place (`tiles` None);
    over an 8-bit one `tiles` lists every block the chunks read, chunk after chunk, which each layer dequantizes
    into one contiguous bf16 buffer, and `batch`'s block tables index that buffer's blocks."""

    batch: PrefillBatch
    tiles: torch.Tensor | None = None  # [Hkv * N] int64 (kv_quant.head_tiles) of the cache's storage

    @classmethod
    def of(cls, cache: LayerKVCache, batch: PrefillBatch) -> tuple[LongPrefill, ...]:
        """One part for a bf16 cache; for an 8-bit one, parts whose buffers hold at most GATHER_TOKENS keys (or one
        chunk each past that): many short chunks over long contexts must not gather every context at once."""
        if not cache.dtype.is_8bit:
            return (cls(batch),)
        block_size = cache.k.shape[1]
        spans = []  # (chunk, first block, end block)
        for i, (q_len, ctx) in enumerate(zip(batch.query_lens.tolist(), batch.seq_lens.tolist())):
            spans.append((i, first_visible_key(ctx - q_len, batch.window) // block_size, -(-ctx // block_size)))
        parts, part = [], []
        for span in spans:
            if part and (sum(e - f for _, f, e in part) + span[2] - span[1]) * block_size > GATHER_TOKENS:
                parts.append(part)
                part = []
            part.append(span)
        return tuple(cls._gathered(cache, batch, p) for p in (*parts, part))

    @classmethod
    def _gathered(cls, cache: LayerKVCache, batch: PrefillBatch, spans: list[tuple[int, int, int]]) -> LongPrefill:
        num_blocks, _, num_kv_heads, _ = cache.k.shape
        index = torch.tensor([i for i, _, _ in spans], dtype=torch.long)
        tables = torch.full_like(batch.block_tables[index], -1)  # entries before a chunk's first visible block
        picked, used = [], 0
        for row, (i, first, end) in enumerate(spans):
            picked.append(batch.block_tables[i, first:end])
            tables[row, first:end] = torch.arange(used, used + end - first, dtype=torch.int32)
            used += end - first
        part = PrefillBatch(batch.rows[index], batch.query_lens[index], batch.seq_lens[index], tables, batch.window)
        return cls(part, head_tiles(torch.cat(picked).long(), num_kv_heads, num_blocks))


GATHER_TOKENS = 16384  # keys per gathered buffer: 12 MiB of K and V at 3 KV heads x 64


def long_prefill_native(
    query: torch.Tensor, out: torch.Tensor, cache: LayerKVCache, long: LongPrefill, scale: float
) -> None:
    """out[long chunks' rows] through the bf16 kernel; query bf16 (`bf16_long_prefill` held when `long` was planned)."""
    if long.tiles is None:
        return prefill_attention_native(query, out, cache, long.batch, scale)
    num_kv_heads, block_size, head_dim = cache.k.shape[2], cache.k.shape[1], cache.k.shape[3]
    k, v = gather_kv_8bit(cache, long.tiles, torch.bfloat16)  # scales applied: the buffer is a plain bf16 cache
    blocks = (num_kv_heads, long.tiles.shape[0] // num_kv_heads, block_size, head_dim)
    ones = torch.ones(num_kv_heads, dtype=torch.float32)
    gathered = LayerKVCache(k.view(blocks).permute(1, 2, 0, 3), v.view(blocks).permute(1, 2, 0, 3), ones, ones,
                            KVDtype.BF16)
    prefill_attention_native(query, out, gathered, long.batch, scale)


def prefill_attention_native(
    query: torch.Tensor, out: torch.Tensor, cache: LayerKVCache, batch: PrefillBatch, scale: float
) -> None:
    """out[chunk rows] = causal attention of each chunk's queries over its cached context and itself; tensors as
    cpu_native.attention_fields takes them, head_dim a multiple of 16."""
    assert query.shape[2] % 16 == 0, f"head_dim {query.shape[2]} is not a multiple of 16"
    fields = attention_fields(query, out, cache, batch, scale)
    args = PrefillArgs(**fields, query_lens=batch.query_lens.data_ptr())
    status = load_library().pagedserve_prefill_attention(
        ctypes.addressof(args), batch.rows.shape[0], torch.get_num_threads()
    )
    if status != 0:
        raise MemoryError("native prefill attention could not allocate its per-thread scratch")
