"""The torch implementation of the PagedAttention entry point: the CPU serving path, and the kernels' reference.

Decode rows (one new token per sequence) run in padded batches of sequences of similar length, as two batched
matmuls (fp32 scores); prefill chunks run per sequence through SDPA (prefill_attention.py), where the matmuls are
large enough that the Python loop costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.attention import AttentionImpl, AttentionMetadata, AttentionPlan, first_visible_key
from pagedserve.kernels.kv_cache import LayerKVCache
from pagedserve.kernels.kv_quant import gather_kv, head_tiles, store_kv
from pagedserve.kernels.prefill_attention import PrefillChunk, prefill_attention, prefill_chunks

# Decode sequences per padded attention call; small enough that lengths within a group are close.
_DECODE_GROUP = 16


@dataclass(frozen=True, slots=True)
class _DecodeGroup:
    """Decode sequences of similar length that share one padded batch."""

    rows: torch.Tensor  # [G] int64: their query rows
    tiles: torch.Tensor  # [Hkv * G * nb] int64: storage tiles of the nb blocks from each one's first visible block
    padding: torch.Tensor  # [1, G, 1, nb * block_size] bool: True for keys past its length or before its window


@dataclass(frozen=True, slots=True)
class TorchPlan(AttentionPlan):
    """Index tensors every layer of a step (with this plan's window) needs: built once per step, not per layer."""

    decode: tuple[_DecodeGroup, ...]
    prefill: tuple[PrefillChunk, ...]


def _decode_group_plan(
    meta: AttentionMetadata, cache: LayerKVCache, starts: list[int], seqs: list[int], window: int | None
) -> _DecodeGroup:
    num_blocks, block_size, num_kv_heads, _ = cache.k.shape
    device = cache.k.device
    lens = torch.tensor([meta.seq_lens_host[i] for i in seqs], device=device)
    skip = [first_visible_key(meta.seq_lens_host[i] - 1, window) // block_size for i in seqs]
    ends = [-(-meta.seq_lens_host[i] // block_size) for i in seqs]
    blocks = max(end - first for end, first in zip(ends, skip))
    first = torch.tensor(skip, device=device)[:, None]
    # Past a shorter sequence's last block, re-read that block: always one of its own (never a freed -1 entry),
    # and masked out below.
    columns = (first + torch.arange(blocks, device=device)).minimum(torch.tensor(ends, device=device)[:, None] - 1)
    seq_index = torch.tensor(seqs, dtype=torch.long, device=device)
    block_ids = meta.block_tables[seq_index[:, None], columns]
    positions = first * block_size + torch.arange(blocks * block_size, device=device)  # absolute key positions
    padding = positions >= lens[:, None]
    if window is not None:
        padding |= positions <= lens[:, None] - 1 - window
    return _DecodeGroup(
        rows=torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device),
        tiles=head_tiles(block_ids.reshape(-1).long(), num_kv_heads, num_blocks),
        padding=padding.view(1, len(seqs), 1, -1),
    )


def _decode_groups(
    meta: AttentionMetadata, cache: LayerKVCache, starts: list[int], window: int | None
) -> tuple[_DecodeGroup, ...]:
    # Sequences of similar length share one padded batch: padding to the batch's longest context would copy
    # (and attend over) far more cached K/V than exists.
    decode = sorted((i for i, q_len in enumerate(meta.query_lens_host) if q_len == 1), key=lambda i: meta.seq_lens_host[i])
    return tuple(
        _decode_group_plan(meta, cache, starts, decode[first : first + _DECODE_GROUP], window)
        for first in range(0, len(decode), _DECODE_GROUP)
    )


class TorchAttention(AttentionImpl[TorchPlan]):
    def plan(self, meta: AttentionMetadata, cache: LayerKVCache, window: int | None = None) -> TorchPlan:
        starts = meta.query_starts()
        decode = _decode_groups(meta, cache, starts, window)
        return TorchPlan(window, decode, prefill_chunks(meta, cache, starts, window))

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        store_kv(key, value, cache, slot_mapping)

    def attention(
        self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, plan: TorchPlan, scale: float
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        for group in plan.decode:
            _decode_group(query, out, cache, scale, group)
        for chunk in plan.prefill:
            prefill_attention(query, out, cache, scale, chunk)
        return out


def _decode_group(query, out, cache: LayerKVCache, scale: float, group: _DecodeGroup) -> None:
    # Two batched matmuls with fp32 scores and softmax rather than SDPA: torch's CPU flash kernel has no
    # fast path for one query row; in bf16 it took 2.9 ms where this takes 0.6 ms (16 sequences x 256
    # tokens, GQA 9/3, one core), and in the engine it was 64% of all bf16 step time.
    groups, length = group.padding.shape[1], group.padding.shape[-1]
    k, v = gather_kv(cache, group.tiles, query.dtype)
    num_kv_heads, head_dim = k.shape[0], k.shape[2]
    k, v = k.view(num_kv_heads, groups, length, head_dim), v.view(num_kv_heads, groups, length, head_dim)
    q = query.index_select(0, group.rows).view(groups, num_kv_heads, -1, head_dim).transpose(0, 1)  # [Hkv, G, H/Hkv, D]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)  # [Hkv, G, H/Hkv, L]
    scores.masked_fill_(group.padding, float("-inf"))
    # Probabilities meet V in the compute dtype, as in FlashAttention; the output is rounded to it anyway.
    probs = scores.softmax(-1).to(query.dtype)
    o = torch.matmul(probs, v).transpose(0, 1)  # [G, Hkv, H/Hkv, D]
    out.index_copy_(0, group.rows, o.reshape(groups, -1, head_dim))
