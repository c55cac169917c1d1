"""Prefill chunks (sequences with more than one new token) through SDPA: shared by the torch and native paths.

The matmuls of a prefill chunk are large enough that torch's SDPA is already fast and the per-sequence Python loop
costs nothing; only decode rows differ between the two CPU implementations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.kernels.kv_cache import LayerKVCache
from pagedserve.kernels.kv_quant import gather_kv, head_tiles


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One sequence's new tokens when there is more than one."""

    start: int  # first query row
    q_len: int
    ctx: int  # cached context + new tokens
    tiles: torch.Tensor  # [Hkv * nb] int64: storage tiles of its blocks
    mask: torch.Tensor | None  # [q_len, ctx] bool, None when the chunk is the whole prompt (plain causal)


def prefill_chunks(meta: AttentionMetadata, cache: LayerKVCache, starts: list[int]) -> tuple[PrefillChunk, ...]:
    """One chunk per sequence with more than one new token; `starts` from `meta.query_starts()`."""
    num_blocks, block_size, num_kv_heads, _ = cache.k.shape
    device = cache.k.device
    chunks = []
    for i, q_len in enumerate(meta.query_lens_host):
        if q_len > 1:
            ctx = meta.seq_lens_host[i]
            mask = None
            if ctx > q_len:  # query j sits at absolute position ctx - q_len + j and sees every key up to there
                q_pos = torch.arange(ctx - q_len, ctx, device=device)
                mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]
            tiles = head_tiles(meta.block_tables[i, : -(-ctx // block_size)].long(), num_kv_heads, num_blocks)
            chunks.append(PrefillChunk(starts[i], q_len, ctx, tiles, mask))
    return tuple(chunks)


def prefill_attention(
    query: torch.Tensor, out: torch.Tensor, cache: LayerKVCache, scale: float, chunk: PrefillChunk
) -> None:
    """out[chunk rows] = attention of the chunk's queries over its cached context and itself (causal)."""
    k, v = gather_kv(cache, chunk.tiles, query.dtype)
    k, v = k[:, : chunk.ctx].unsqueeze(0), v[:, : chunk.ctx].unsqueeze(0)  # [1, Hkv, ctx, D]
    q = query[chunk.start : chunk.start + chunk.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
    if chunk.mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
    out[chunk.start : chunk.start + chunk.q_len] = o.squeeze(0).transpose(0, 1)
