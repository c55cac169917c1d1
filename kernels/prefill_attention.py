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
    seen_by_all: int = 0  # > 0: every query sees the first this many keys (the cached past): fp32 queries split there
    # (_past_then_causal) instead of applying the mask, which 16-bit queries keep


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
            # first_key is 0 when no window bites
            seen_by_all = past if (window is None or window >= ctx) and _split_past(device, q_len, ctx) else 0
            tiles = head_tiles(meta.block_tables[i, first_block : -(-ctx // block_size)].long(), num_kv_heads, num_blocks)
            chunks.append(PrefillChunk(starts[i], q_len, ctx - first_key, tiles, mask, seen_by_all))
    return tuple(chunks)


def _split_past(device: torch.device, new: int, keys: int) -> bool:
    """Whether a chunk of `new` tokens over a cached past (`keys` in all) takes _past_then_causal: on CPU, where torch's
    flash kernel returns the log-sum-exp the two halves are merged by (its CUDA kernels keep the mask), for chunks
    long enough that the causal half skips key blocks, or whose mask is large. Below both, the two ways do the same
    products and the second call's fixed cost decides: 512 new tokens over 100 cached took 1.32x the masked call's
    time split, 64 over 64 1.3x."""
    if device.type != "cpu" or _FLASH_CPU is None:
        return False
    return new >= _SPLIT_MIN_NEW or new * keys >= _SPLIT_MIN_MASK


# Chosen on 58 (new, cached) shapes at the AVX2 and AVX-512 tiers, one layer of SmolLM2's attention, 2 threads
# (benchmarks/sdpa_prefill_ab.py --grid): from 768 new tokens the split took 0.52-0.82x the masked call's time, with
# masks of 2^20 entries or more 0.85-0.97x, and below both 0.79-1.42x; confirmed on 10 shapes it was not chosen on
# (docs/benchmarks.md, "Prefill chunks over a cached past").
_SPLIT_MIN_NEW = 768
_SPLIT_MIN_MASK = 1 << 20


def _past_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, past: int) -> torch.Tensor:
    """fp32 attention of a chunk whose queries all see the first `past` keys and then the chunk's own keys causally:
    two calls of torch's CPU flash kernel, one unmasked over the past and one plain causal over the chunk, merged by
    their log-sum-exps. Why: with a boolean mask SDPA materializes it as floats, adds it to every score, and computes
    the key blocks it masks out; split, the chunks _split_past sends here took 0.52-0.97x the masked call's time (a
    2,048-token chunk over 2,048 cached keys 0.61-0.67x; AVX2 and AVX-512, 2 threads; the same values to ~1e-7).
    fp32 only: 16-bit halves would each be rounded before the merge."""
    head, head_lse = _FLASH_CPU(q, k[:, :, :past], v[:, :, :past], 0.0, False, scale=scale)
    tail, tail_lse = _FLASH_CPU(q, k[:, :, past:], v[:, :, past:], 0.0, True, scale=scale)
    lse = torch.logaddexp(head_lse, tail_lse)
    return head * torch.exp(head_lse - lse).unsqueeze(-1) + tail * torch.exp(tail_lse - lse).unsqueeze(-1)


# torch's CPU flash attention with its log-sum-exp (what F.scaled_dot_product_attention calls on CPU); GQA is native.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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
    if chunk.seen_by_all and q.dtype == torch.float32:
        o = _past_then_causal(q, k, v, scale, chunk.seen_by_all)
    elif chunk.mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
    out[chunk.start : chunk.start + chunk.q_len] = o.squeeze(0).transpose(0, 1)
