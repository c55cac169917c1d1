"""The CPU serving path of the PagedAttention entry point: torch code, with decode rows in one native call.

Prefill chunks take the shared SDPA path (prefill_attention.py: large matmuls, where torch is already fast); every
decode row of a step goes through cpu_decode_attention.c, which reads K/V blocks in place instead of gathering and
upcasting them. `auto` picks this on CPU whenever the C file builds here, and falls back to pure torch (logging
why) when it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.attention import AttentionImpl, AttentionMetadata, AttentionPlan
from pagedserve.kernels.cpu_native import DecodeBatch, decode_attention, load_library
from pagedserve.kernels.kv_cache import LayerKVCache
from pagedserve.kernels.kv_quant import store_kv
from pagedserve.kernels.prefill_attention import PrefillChunk, prefill_attention, prefill_chunks


@dataclass(frozen=True, slots=True)
class NativePlan(AttentionPlan):
    decode: DecodeBatch | None  # None when no sequence decodes this step
    prefill: tuple[PrefillChunk, ...]


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


class NativeCpuAttention(AttentionImpl[NativePlan]):
    def __init__(self) -> None:
        load_library()  # asked for by name, a missing compiler is an error here, not a silent fallback

    def plan(self, meta: AttentionMetadata, cache: LayerKVCache, window: int | None = None) -> NativePlan:
        starts = meta.query_starts()
        return NativePlan(window, _decode_batch(meta, starts, window), prefill_chunks(meta, cache, starts, window))

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        store_kv(key, value, cache, slot_mapping)

    def attention(
        self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, plan: NativePlan, scale: float
    ) -> torch.Tensor:
        assert query.device.type == "cpu", "the native attention runs on CPU tensors only"
        if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype)
        if plan.decode is not None:
            decode_attention(
                query, out, LayerKVCache.by_head(cache.k), LayerKVCache.by_head(cache.v),
                cache.k_scale, cache.v_scale, plan.decode, scale,
            )
        for chunk in plan.prefill:
            prefill_attention(query, out, cache, scale, chunk)
        return out
