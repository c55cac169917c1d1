"""The torch implementation of the PagedAttention entry point: the CPU serving path, and the kernels' reference.

Decode rows (one new token per sequence) run in padded batches of sequences of similar length, as two batched
matmuls (fp32 scores); prefill chunks run per sequence through SDPA, where the matmuls are large enough that the
Python loop costs nothing.
"""

from __future__ import annotations

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


@ATTENTION_IMPLS.register("torch")
class TorchAttention(AttentionImpl):
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        _store(cache.k, slot_mapping, quantize_for_cache(key, cache.k_scale, cache.dtype))
        _store(cache.v, slot_mapping, quantize_for_cache(value, cache.v_scale, cache.dtype))

    def attention(self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        starts = [0]
        for q_len in meta.query_lens_host:
            starts.append(starts[-1] + q_len)
        decode = [i for i, q_len in enumerate(meta.query_lens_host) if q_len == 1]
        if decode:
            self._decode(query, out, cache, meta, scale, decode, starts)
        for i, q_len in enumerate(meta.query_lens_host):
            if q_len > 1:
                self._prefill(query, out, cache, meta, scale, i, starts[i], q_len)
        return out

    def _gather(self, cache: LayerKVCache, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """block_ids [N, nb] -> K, V [N, nb * block_size, Hkv, D] in `dtype` (index_select: a plain row copy)."""
        flat = block_ids.reshape(-1)
        shape = (block_ids.shape[0], -1, *cache.k.shape[2:])
        k = cache.k.index_select(0, flat).view(shape)
        v = cache.v.index_select(0, flat).view(shape)
        return (
            dequantize_from_cache(k, cache.k_scale, cache.dtype, dtype),
            dequantize_from_cache(v, cache.v_scale, cache.dtype, dtype),
        )

    def _decode(self, query, out, cache, meta, scale, seqs: list[int], starts: list[int]) -> None:
        # Sequences of similar length share one padded SDPA call: padding to the batch's longest context
        # would copy (and attend over) far more cached K/V than exists.
        by_length = sorted(seqs, key=lambda i: meta.seq_lens_host[i])
        for first in range(0, len(by_length), _DECODE_GROUP):
            self._decode_group(query, out, cache, meta, scale, by_length[first : first + _DECODE_GROUP], starts)

    def _decode_group(self, query, out, cache, meta, scale, seqs: list[int], starts: list[int]) -> None:
        # Two batched matmuls with fp32 scores and softmax rather than SDPA: torch's CPU flash kernel has no
        # fast path for one query row; in bf16 it took 2.9 ms where this takes 0.6 ms (16 sequences x 256
        # tokens, GQA 9/3, one core), and in the engine it was 64% of all bf16 step time.
        block_size = cache.k.shape[1]
        num_blocks = -(-max(meta.seq_lens_host[i] for i in seqs) // block_size)
        seq_index = torch.tensor(seqs, dtype=torch.long, device=query.device)
        rows = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=query.device)
        k, v = self._gather(cache, meta.block_tables[seq_index, :num_blocks].long(), query.dtype)  # [G, L, Hkv, D]
        groups, length, num_kv_heads, head_dim = k.shape
        keys = torch.empty((groups, num_kv_heads, length, head_dim), dtype=torch.float32, device=k.device)
        keys.copy_(k.transpose(1, 2))  # one pass: transpose and upcast together
        q = query.index_select(0, rows).view(groups, num_kv_heads, -1, head_dim).float()  # [G, Hkv, H/Hkv, D]
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)  # [G, Hkv, H/Hkv, L]
        padding = torch.arange(length, device=query.device)[None, :] >= meta.seq_lens[seq_index][:, None]
        scores.masked_fill_(padding.view(groups, 1, 1, length), float("-inf"))
        # Probabilities meet V in the compute dtype, as in FlashAttention; the output is rounded to it anyway.
        probs = scores.softmax(-1).to(query.dtype)
        o = torch.matmul(probs, v.transpose(1, 2))  # [G, Hkv, H/Hkv, D]
        out.index_copy_(0, rows, o.view(groups, -1, head_dim))

    def _prefill(self, query, out, cache, meta, scale, seq: int, start: int, q_len: int) -> None:
        block_size = cache.k.shape[1]
        ctx = meta.seq_lens_host[seq]
        num_blocks = (ctx + block_size - 1) // block_size
        k, v = self._gather(cache, meta.block_tables[seq : seq + 1, :num_blocks].long(), query.dtype)
        k, v = k[0, :ctx].transpose(0, 1).unsqueeze(0), v[0, :ctx].transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
        q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if ctx == q_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query j sits at absolute position ctx - q_len + j and sees every key up to there.
            q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
            mask = torch.arange(ctx, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = o.squeeze(0).transpose(0, 1)
