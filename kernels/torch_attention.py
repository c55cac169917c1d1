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


def dequantize_from_cache(x: torch.Tensor, scale: torch.Tensor, dtype: KVDtype, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., Hkv, D] in cache dtype -> out_dtype, multiplying FP8 values by their per-head scale."""
    if not dtype.is_fp8:
        return x.to(out_dtype)
    values, factor = _fp8_to_float(x)
    # scale * 2^8 is exact, so each product is rounded once, exactly like x.float() * scale.
    return (values * (scale * factor).view(*([1] * (x.dim() - 2)), -1, 1)).to(out_dtype)


def _store(cache_tensor: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    flat = cache_tensor.view(-1, *cache_tensor.shape[2:])  # [num_blocks * block_size, Hkv, D]
    if values.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # CPU torch lacks FP8 index_put kernels for some paths; bytes are bytes.
        flat.view(torch.uint8)[slots] = values.view(torch.uint8)
    else:
        flat[slots] = values


@dataclass(frozen=True, slots=True)
class _DecodeGroup:
    """Decode sequences of similar length that share one padded batch."""

    rows: torch.Tensor  # [G] int64: their query rows
    block_ids: torch.Tensor  # [G * nb] int64: their first nb blocks, nb covering the longest of them
    padding: torch.Tensor  # [G, 1, 1, nb * block_size] bool: True past each sequence's length


@dataclass(frozen=True, slots=True)
class _PrefillChunk:
    start: int  # first query row
    q_len: int
    ctx: int  # cached context + new tokens
    block_ids: torch.Tensor  # [nb] int64
    mask: torch.Tensor | None  # [q_len, ctx] bool, None when the chunk is the whole prompt (plain causal)


@dataclass(frozen=True, slots=True)
class _StepPlan:
    """Index tensors every layer of a step needs: built once per AttentionMetadata, not once per layer."""

    decode: tuple[_DecodeGroup, ...]
    prefill: tuple[_PrefillChunk, ...]


def _plan_step(meta: AttentionMetadata, block_size: int, device: torch.device) -> _StepPlan:
    starts = [0]
    for q_len in meta.query_lens_host:
        starts.append(starts[-1] + q_len)
    # Sequences of similar length share one padded batch: padding to the batch's longest context would copy
    # (and attend over) far more cached K/V than exists.
    decode = sorted((i for i, q_len in enumerate(meta.query_lens_host) if q_len == 1), key=lambda i: meta.seq_lens_host[i])
    groups = []
    for first in range(0, len(decode), _DECODE_GROUP):
        seqs = decode[first : first + _DECODE_GROUP]
        num_blocks = -(-max(meta.seq_lens_host[i] for i in seqs) // block_size)
        seq_index = torch.tensor(seqs, dtype=torch.long, device=device)
        positions = torch.arange(num_blocks * block_size, device=device)
        padding = positions[None, :] >= meta.seq_lens[seq_index][:, None]
        groups.append(_DecodeGroup(
            rows=torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device),
            block_ids=meta.block_tables[seq_index, :num_blocks].reshape(-1).long(),
            padding=padding.view(len(seqs), 1, 1, -1),
        ))
    chunks = []
    for i, q_len in enumerate(meta.query_lens_host):
        if q_len > 1:
            ctx = meta.seq_lens_host[i]
            mask = None
            if ctx > q_len:  # query j sits at absolute position ctx - q_len + j and sees every key up to there
                q_pos = torch.arange(ctx - q_len, ctx, device=device)
                mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]
            block_ids = meta.block_tables[i, : -(-ctx // block_size)].long()
            chunks.append(_PrefillChunk(starts[i], q_len, ctx, block_ids, mask))
    return _StepPlan(tuple(groups), tuple(chunks))


@ATTENTION_IMPLS.register("torch")
class TorchAttention(AttentionImpl):
    def __init__(self) -> None:
        self._plan: tuple[AttentionMetadata, _StepPlan] | None = None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        _store(cache.k, slot_mapping, quantize_for_cache(key, cache.k_scale, cache.dtype))
        _store(cache.v, slot_mapping, quantize_for_cache(value, cache.v_scale, cache.dtype))

    def attention(self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self._plan is None or self._plan[0] is not meta:
            self._plan = (meta, _plan_step(meta, cache.k.shape[1], query.device))
        plan = self._plan[1]
        out = torch.empty_like(query)
        for group in plan.decode:
            self._decode_group(query, out, cache, scale, group)
        for chunk in plan.prefill:
            self._prefill(query, out, cache, scale, chunk)
        return out

    def _gather(self, cache: LayerKVCache, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """block_ids [N * nb] -> K, V [N * nb, block_size, Hkv, D] in `dtype` (index_select: a plain row copy)."""
        k = cache.k.index_select(0, block_ids)
        v = cache.v.index_select(0, block_ids)
        return (
            dequantize_from_cache(k, cache.k_scale, cache.dtype, dtype),
            dequantize_from_cache(v, cache.v_scale, cache.dtype, dtype),
        )

    def _decode_group(self, query, out, cache, scale: float, group: _DecodeGroup) -> None:
        # Two batched matmuls with fp32 scores and softmax rather than SDPA: torch's CPU flash kernel has no
        # fast path for one query row; in bf16 it took 2.9 ms where this takes 0.6 ms (16 sequences x 256
        # tokens, GQA 9/3, one core), and in the engine it was 64% of all bf16 step time.
        groups, length = group.padding.shape[0], group.padding.shape[-1]
        k, v = self._gather(cache, group.block_ids, query.dtype)
        k, v = k.view(groups, length, *k.shape[2:]), v.view(groups, length, *v.shape[2:])  # [G, L, Hkv, D]
        num_kv_heads, head_dim = k.shape[2], k.shape[3]
        keys = torch.empty((groups, num_kv_heads, length, head_dim), dtype=torch.float32, device=k.device)
        keys.copy_(k.transpose(1, 2))  # one pass: transpose and upcast together
        q = query.index_select(0, group.rows).view(groups, num_kv_heads, -1, head_dim).float()  # [G, Hkv, H/Hkv, D]
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)  # [G, Hkv, H/Hkv, L]
        scores.masked_fill_(group.padding, float("-inf"))
        # Probabilities meet V in the compute dtype, as in FlashAttention; the output is rounded to it anyway.
        probs = scores.softmax(-1).to(query.dtype)
        o = torch.matmul(probs, v.transpose(1, 2))  # [G, Hkv, H/Hkv, D]
        out.index_copy_(0, group.rows, o.view(groups, -1, head_dim))

    def _prefill(self, query, out, cache, scale: float, chunk: _PrefillChunk) -> None:
        k, v = self._gather(cache, chunk.block_ids, query.dtype)
        k = k.flatten(0, 1)[: chunk.ctx].transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
        v = v.flatten(0, 1)[: chunk.ctx].transpose(0, 1).unsqueeze(0)
        q = query[chunk.start : chunk.start + chunk.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if chunk.mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
        out[chunk.start : chunk.start + chunk.q_len] = o.squeeze(0).transpose(0, 1)
