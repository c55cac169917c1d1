"""The torch implementation of the PagedAttention entry point: the CPU serving path, and the kernels' reference.

Decode rows (one new token per sequence) run in padded batches of sequences of similar length, as two batched
matmuls (fp32 scores); prefill chunks run per sequence through SDPA (prefill_attention.py), where the matmuls are
large enough that the Python loop costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.attention import AttentionImpl, AttentionMetadata
from pagedserve.kernels.kv_cache import LayerKVCache
from pagedserve.kernels.kv_quant import gather_kv, head_tiles, store_kv
from pagedserve.kernels.prefill_attention import PrefillChunk, prefill_attention, prefill_chunks

# Decode sequences per padded attention call; small enough that lengths within a group are close.
_DECODE_GROUP = 16


@dataclass(frozen=True, slots=True)
class _DecodeGroup:
    """Decode sequences of similar length that share one padded batch."""

    rows: torch.Tensor  # [G] int64: their query rows
    tiles: torch.Tensor  # [Hkv * G * nb] int64: storage tiles of their first nb blocks (nb covers the longest)
    padding: torch.Tensor  # [1, G, 1, nb * block_size] bool: True past each sequence's length


@dataclass(frozen=True, slots=True)
class TorchPlan:
    """Index tensors every layer of a step needs: built once per step, not once per layer."""

    decode: tuple[_DecodeGroup, ...]
    prefill: tuple[PrefillChunk, ...]


def _decode_groups(meta: AttentionMetadata, cache: LayerKVCache, starts: list[int]) -> tuple[_DecodeGroup, ...]:
    num_blocks, block_size, num_kv_heads, _ = cache.k.shape
    device = cache.k.device
    # Sequences of similar length share one padded batch: padding to the batch's longest context would copy
    # (and attend over) far more cached K/V than exists.
    decode = sorted((i for i, q_len in enumerate(meta.query_lens_host) if q_len == 1), key=lambda i: meta.seq_lens_host[i])
    groups = []
    for first in range(0, len(decode), _DECODE_GROUP):
        seqs = decode[first : first + _DECODE_GROUP]
        blocks = -(-max(meta.seq_lens_host[i] for i in seqs) // block_size)
        seq_index = torch.tensor(seqs, dtype=torch.long, device=device)
        positions = torch.arange(blocks * block_size, device=device)
        padding = positions[None, :] >= meta.seq_lens[seq_index][:, None]
        groups.append(_DecodeGroup(
            rows=torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device),
            tiles=head_tiles(meta.block_tables[seq_index, :blocks].reshape(-1).long(), num_kv_heads, num_blocks),
            padding=padding.view(1, len(seqs), 1, -1),
        ))
    return tuple(groups)


class TorchAttention(AttentionImpl[TorchPlan]):
    def plan(self, meta: AttentionMetadata, cache: LayerKVCache) -> TorchPlan:
        starts = meta.query_starts()
        return TorchPlan(_decode_groups(meta, cache, starts), prefill_chunks(meta, cache, starts))

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
