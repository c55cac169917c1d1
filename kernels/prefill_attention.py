"""Prefill chunks (sequences with more than one new token) through SDPA: the torch path's prefill, and the native
path's for long chunks and for head dims that are not a multiple of 16 (kernels/cpu/prefill_attention.c takes short
chunks)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels.attention import AttentionMetadata, first_visible_key
from pagedserve.kernels.kv_cache import LayerKVCache
from pagedserve.kernels.kv_quant import gather_kv, head_tiles


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One sequence's new tokens when there is more than one."""

    start: int  # first query row
    q_len: int
    keys: int  # keys gathered: from the first block holding a visible key to the end of the context
    tiles: torch.Tensor  # [Hkv * nb] int64: storage tiles of those blocks
    mask: torch.Tensor | None  # [q_len, keys] bool (True: visible), None when plain causal over the whole prompt


def _visible(past: int, ctx: int, first_key: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[ctx - past, ctx - first_key] bool: query j (at absolute position past + j) sees key i (at first_key + i)."""
    q_pos = torch.arange(past, ctx, device=device)[:, None]
    k_pos = torch.arange(first_key, ctx, device=device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return visible


def prefill_chunks(
    meta: AttentionMetadata, cache: LayerKVCache, starts: list[int], window: int | None = None,
    picked: tuple[int, ...] | None = None,
) -> tuple[PrefillChunk, ...]:
    """One chunk per sequence with more than one new token (of those in `picked`, when given); `starts` from
    `meta.query_starts()`."""
    num_blocks, block_size, num_kv_heads, _ = cache.k.shape
    device = cache.k.device
    chunks = []
    for i, q_len in enumerate(meta.query_lens_host):
        if q_len > 1 and (picked is None or i in picked):
            ctx = meta.seq_lens_host[i]
            past = ctx - q_len
            # Blocks wholly before the first query's window hold no visible key (and may be freed): not read.
            first_block = first_visible_key(past, window) // block_size
            first_key = first_block * block_size
            mask = None
            if past or (window is not None and window < ctx):
                mask = _visible(past, ctx, first_key, window, device)
            tiles = head_tiles(meta.block_tables[i, first_block : -(-ctx // block_size)].long(), num_kv_heads, num_blocks)
            chunks.append(PrefillChunk(starts[i], q_len, ctx - first_key, tiles, mask))
    return tuple(chunks)


Gather = Callable[[LayerKVCache, torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]]


def prefill_attention(
    query: torch.Tensor, out: torch.Tensor, cache: LayerKVCache, scale: float, chunk: PrefillChunk,
    gather: Gather = gather_kv,
) -> None:
    """out[chunk rows] = attention of the chunk's queries over its visible cached context and itself. `gather`:
    kv_quant.gather_kv or a native one that returns the same values."""
    k, v = gather(cache, chunk.tiles, query.dtype)
    k, v = k[:, : chunk.keys].unsqueeze(0), v[:, : chunk.keys].unsqueeze(0)  # [1, Hkv, keys, D]
    q = query[chunk.start : chunk.start + chunk.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
    if chunk.mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
    out[chunk.start : chunk.start + chunk.q_len] = o.squeeze(0).transpose(0, 1)
