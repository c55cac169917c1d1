"""Triton KV-cache write: store each new token's K and V into its slot, quantizing to FP8 when the cache is FP8.

One program per token covers all KV heads. FP8 stores divide by the per-KV-head scale and clamp to the finite
range first, exactly like quantize_for_cache on the torch path, so both paths saturate the same way
(torch's e5m2 cast would otherwise produce inf). Slots < 0 mark padding tokens and are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.kv_cache import LayerKVCache


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    stride_in_tok, stride_in_head, stride_c_block, stride_c_pos, stride_c_head,
    fp8_max,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    pos = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    ok = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    in_off = tok * stride_in_tok + offs_h.to(tl.int64)[:, None] * stride_in_head + offs_d[None, :]
    out_off = block * stride_c_block + pos * stride_c_pos + offs_h.to(tl.int64)[:, None] * stride_c_head
    out_off = out_off + offs_d[None, :]
    k = tl.load(key_ptr + in_off, mask=ok, other=0.0)
    v = tl.load(value_ptr + in_off, mask=ok, other=0.0)
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr + offs_h, mask=offs_h < NUM_KV_HEADS, other=1.0)
        v_scale = tl.load(v_scale_ptr + offs_h, mask=offs_h < NUM_KV_HEADS, other=1.0)
        # div_rn: IEEE division like torch's, not the GPU's default approximate fp32 divide.
        k = tl.clamp(tl.math.div_rn(k.to(tl.float32), k_scale[:, None]), -fp8_max, fp8_max)
        v = tl.clamp(tl.math.div_rn(v.to(tl.float32), v_scale[:, None]), -fp8_max, fp8_max)
        k = k.to(k_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        v = v.to(v_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    else:
        k = k.to(k_cache_ptr.dtype.element_ty)
        v = v.to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + out_off, k, mask=ok)
    tl.store(v_cache_ptr + out_off, v, mask=ok)


def triton_write_kv(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] -> their slots in cache.k / cache.v (same contract as paged_attention.write_kv)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride() == value.stride() and key.stride(2) == 1, "key/value must share a layout, last dim contiguous"
    assert cache.k.stride() == cache.v.stride() and cache.k.stride(3) == 1, "K and V caches must share a layout"
    block_size = cache.k.shape[1]
    _kv_write_kernel[(num_tokens,)](
        key, value, cache.k, cache.v, cache.k_scale, cache.v_scale, slot_mapping,
        key.stride(0), key.stride(1), cache.k.stride(0), cache.k.stride(1), cache.k.stride(2),
        cache.dtype.fp8_max if cache.dtype.is_fp8 else 0.0,
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        IS_FP8=cache.dtype.is_fp8,
    )
