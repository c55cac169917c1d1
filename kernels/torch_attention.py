"""The torch implementation of the PagedAttention entry point: the CPU serving path, and the kernels' reference.

Decode rows (one new token per sequence) run in padded batches of sequences of similar length, as two batched
matmuls (fp32 scores); prefill chunks run per sequence through SDPA, where the matmuls are large enough that the
Python loop costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels.kv_cache import KVDtype, LayerKVCache
from pagedserve.kernels.paged_attention import ATTENTION_IMPLS, AttentionImpl, AttentionMetadata


# Decode sequences per padded attention call; small enough that lengths within a group are close.
_DECODE_GROUP = 16


def quantize_for_cache(x: torch.Tensor, scale: torch.Tensor, dtype: KVDtype) -> torch.Tensor:
    """x [T, Hkv, D] -> cache dtype. FP8 divides by the per-head scale and clamps to the finite range."""
    if not dtype.is_fp8:
        return x.to(dtype.torch_dtype)
    limit = dtype.fp8_max
    scaled = x.float() / scale.view(1, -1, 1)
    return scaled.clamp_(-limit, limit).to(dtype.torch_dtype)


def _fp8_to_float(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """FP8 -> fp32 exactly, as (values, factor the values must still be multiplied by).

    torch's CPU e4m3 -> fp32 cast is scalar code; moving the e4m3 bits into fp16's places (exponent and mantissa
    fields aligned, so the fp16 reads 2^-8 times the value, subnormals included) converts vectorized, ~2x faster.
    Only NaN differs (it reads as 480): stores clamp, so the cache never holds one.
    """
    if x.dtype == torch.float8_e4m3fn and x.device.type == "cpu":
        bits = x.view(torch.uint8).to(torch.int16)
        return (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).view(torch.float16).float(), 256.0
    return x.float(), 1.0


def dequantize_from_cache(
    x: torch.Tensor, scale: torch.Tensor, dtype: KVDtype, out_dtype: torch.dtype, head_axis: int = -2
) -> torch.Tensor:
    """x in cache dtype, KV heads along `head_axis` ([..., Hkv, D] by default) -> out_dtype, FP8 times its head's scale."""
    if not dtype.is_fp8:
        return x.to(out_dtype)
    values, factor = _fp8_to_float(x)
    shape = [1] * x.dim()
    shape[head_axis] = -1
    # scale * 2^8 is exact, so each product is rounded once, exactly like x.float() * scale.
    return (values * (scale * factor).view(shape)).to(out_dtype)


def _store(cache_tensor: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """values [T, Hkv, D] -> their slots of every head's tiles in the head-major storage."""
    storage = LayerKVCache.by_head(cache_tensor)
    flat = storage.view(storage.shape[0], -1, storage.shape[3])  # [Hkv, num_blocks * block_size, D]
    if values.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # CPU torch lacks FP8 index_put kernels for some paths; bytes are bytes.
        flat, values = flat.view(torch.uint8), values.view(torch.uint8)
    flat[:, slots] = values.transpose(0, 1)


def _head_tiles(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """block_ids [N] -> rows [Hkv * N] of the storage viewed as [Hkv * num_blocks, block_size, D], head-major."""
    heads = torch.arange(num_kv_heads, device=block_ids.device, dtype=torch.long)
    return (heads[:, None] * num_blocks + block_ids[None, :]).reshape(-1)


@dataclass(frozen=True, slots=True)
class _DecodeGroup:
    """Decode sequences of similar length that share one padded batch."""

    rows: torch.Tensor  # [G] int64: their query rows
    tiles: torch.Tensor  # [Hkv * G * nb] int64: storage tiles of their first nb blocks (nb covers the longest)
    padding: torch.Tensor  # [1, G, 1, nb * block_size] bool: True past each sequence's length


@dataclass(frozen=True, slots=True)
class _PrefillChunk:
    start: int  # first query row
    q_len: int
    ctx: int  # cached context + new tokens
    tiles: torch.Tensor  # [Hkv * nb] int64: storage tiles of its blocks
    mask: torch.Tensor | None  # [q_len, ctx] bool, None when the chunk is the whole prompt (plain causal)


@dataclass(frozen=True, slots=True)
class _StepPlan:
    """Index tensors every layer of a step needs: built once per AttentionMetadata, not once per layer."""

    decode: tuple[_DecodeGroup, ...]
    prefill: tuple[_PrefillChunk, ...]


def query_starts(meta: AttentionMetadata) -> list[int]:
    """Each sequence's first query row (host copy of query_start_loc, without a device sync)."""
    starts = [0]
    for q_len in meta.query_lens_host:
        starts.append(starts[-1] + q_len)
    return starts


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
            tiles=_head_tiles(meta.block_tables[seq_index, :blocks].reshape(-1).long(), num_kv_heads, num_blocks),
            padding=padding.view(1, len(seqs), 1, -1),
        ))
    return tuple(groups)


def prefill_chunks(meta: AttentionMetadata, cache: LayerKVCache, starts: list[int]) -> tuple[_PrefillChunk, ...]:
    """One chunk per sequence with more than one new token."""
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
            tiles = _head_tiles(meta.block_tables[i, : -(-ctx // block_size)].long(), num_kv_heads, num_blocks)
            chunks.append(_PrefillChunk(starts[i], q_len, ctx, tiles, mask))
    return tuple(chunks)


def _plan_step(meta: AttentionMetadata, cache: LayerKVCache) -> _StepPlan:
    starts = query_starts(meta)
    return _StepPlan(_decode_groups(meta, cache, starts), prefill_chunks(meta, cache, starts))


@ATTENTION_IMPLS.register("torch")
class TorchAttention(AttentionImpl):
    def __init__(self) -> None:
        self._plan: tuple[AttentionMetadata, _StepPlan] | None = None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        _store(cache.k, slot_mapping, quantize_for_cache(key, cache.k_scale, cache.dtype))
        _store(cache.v, slot_mapping, quantize_for_cache(value, cache.v_scale, cache.dtype))

    def attention(self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self._plan is None or self._plan[0] is not meta:
            self._plan = (meta, _plan_step(meta, cache))
        plan = self._plan[1]
        out = torch.empty_like(query)
        for group in plan.decode:
            self._decode_group(query, out, cache, scale, group)
        for chunk in plan.prefill:
            self.prefill(query, out, cache, scale, chunk)
        return out

    def _gather(self, cache: LayerKVCache, tiles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """tiles [Hkv * N] -> K, V [Hkv, N * block_size, D] in `dtype` (index_select of whole tiles: a row copy)."""
        out = []
        for tensor, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
            storage = LayerKVCache.by_head(tensor)
            num_kv_heads, _, block_size, head_dim = storage.shape
            picked = storage.view(-1, block_size, head_dim).index_select(0, tiles).view(num_kv_heads, -1, head_dim)
            out.append(dequantize_from_cache(picked, scale, cache.dtype, dtype, head_axis=0))
        return out[0], out[1]

    def _decode_group(self, query, out, cache, scale: float, group: _DecodeGroup) -> None:
        # Two batched matmuls with fp32 scores and softmax rather than SDPA: torch's CPU flash kernel has no
        # fast path for one query row; in bf16 it took 2.9 ms where this takes 0.6 ms (16 sequences x 256
        # tokens, GQA 9/3, one core), and in the engine it was 64% of all bf16 step time.
        groups, length = group.padding.shape[1], group.padding.shape[-1]
        k, v = self._gather(cache, group.tiles, query.dtype)
        num_kv_heads, head_dim = k.shape[0], k.shape[2]
        k, v = k.view(num_kv_heads, groups, length, head_dim), v.view(num_kv_heads, groups, length, head_dim)
        q = query.index_select(0, group.rows).view(groups, num_kv_heads, -1, head_dim).transpose(0, 1)  # [Hkv, G, H/Hkv, D]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)  # [Hkv, G, H/Hkv, L]
        scores.masked_fill_(group.padding, float("-inf"))
        # Probabilities meet V in the compute dtype, as in FlashAttention; the output is rounded to it anyway.
        probs = scores.softmax(-1).to(query.dtype)
        o = torch.matmul(probs, v).transpose(0, 1)  # [G, Hkv, H/Hkv, D]
        out.index_copy_(0, group.rows, o.reshape(groups, -1, head_dim))

    def prefill(self, query, out, cache, scale: float, chunk: _PrefillChunk) -> None:
        k, v = self._gather(cache, chunk.tiles, query.dtype)
        k, v = k[:, : chunk.ctx].unsqueeze(0), v[:, : chunk.ctx].unsqueeze(0)  # [1, Hkv, ctx, D]
        q = query[chunk.start : chunk.start + chunk.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if chunk.mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
        out[chunk.start : chunk.start + chunk.q_len] = o.squeeze(0).transpose(0, 1)
