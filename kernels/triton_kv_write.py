"""Triton KV-cache write: store each new token's K and V into its slot, quantizing to FP8 or int8 when the cache is.

One program per (token, K or V) covers all KV heads. FP8 stores divide by the per-KV-head scale and clamp to the finite
range first, exactly like quantize_for_cache on the torch path, so both paths saturate the same way
(torch's e5m2 cast would otherwise produce inf). Slots < 0 mark padding tokens and are skipped.
Under Triton's CPU interpreter the narrowing is done in fp32 arithmetic first (ROUND_IN_FP32), because the
interpreter's own fp32 -> fp8 cast rounds ties away from zero, drops the carry into the exponent (-31.07 -> -16)
and flushes subnormals, and its fp32 -> bf16 cast truncates; with it the interpreted kernel is bit-exact.
int8 rows take their fp16 scale from the row's amax and are rounded in fp32 arithmetic on every target, so the
interpreted and compiled kernels and the torch path store the same bytes.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedserve.kernels.kv_cache import KVDtype, LayerKVCache


@triton.jit
def _int8_rows(x, ok):
    """x [Hkv, D] -> (its rows rounded to integers in [-127, 127] as fp32, each row's fp16 scale): kv_quant.py's
    quantize_rows_int8 step by step (IEEE divisions, round half to even), so the bytes are the torch path's."""
    x = tl.where(ok, x.to(tl.float32), 0.0)
    scale = tl.minimum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0), 65504.0).to(tl.float16)
    divisor = scale.to(tl.float32)
    y = tl.math.div_rn(x, tl.where(divisor > 0.0, divisor, 1.0)[:, None])
    y = tl.where(divisor[:, None] > 0.0, y, 0.0)
    # + 1.5 * 2^23 leaves no fraction bits: the add rounds half to even (|y| <= 128 here), the subtract is exact.
    y = (y + 12582912.0) - 12582912.0
    return tl.clamp(y, -127.0, 127.0), scale


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_c_block, stride_c_pos, stride_c_head,
    fp8_max,
    k_row_scale_ptr, v_row_scale_ptr, stride_s_block, stride_s_pos, stride_s_head,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr, ROUND_IN_FP32: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr,
    IS_INT8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    # Axis 1 picks K (0) or V (1): one body for both.
    src_ptr = key_ptr
    dst_ptr = k_cache_ptr
    scale_ptr = k_scale_ptr
    row_scale_ptr = k_row_scale_ptr
    stride_tok = stride_k_tok
    stride_head = stride_k_head
    if tl.program_id(1) == 1:
        src_ptr = value_ptr
        dst_ptr = v_cache_ptr
        scale_ptr = v_scale_ptr
        row_scale_ptr = v_row_scale_ptr
        stride_tok = stride_v_tok
        stride_head = stride_v_head
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    head_ok = offs_h < NUM_KV_HEADS
    ok = head_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    src_off = tok * stride_tok + offs_h.to(tl.int64)[:, None] * stride_head + offs_d[None, :]
    dst_off = (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_pos
    dst_off = dst_off + offs_h.to(tl.int64)[:, None] * stride_c_head + offs_d[None, :]
    x = tl.load(src_ptr + src_off, mask=ok, other=0.0)
    if IS_INT8:
        rows, row_scale = _int8_rows(x, ok)
        s_off = (slot // BLOCK_SIZE) * stride_s_block + (slot % BLOCK_SIZE) * stride_s_pos
        tl.store(row_scale_ptr + s_off + offs_h.to(tl.int64) * stride_s_head, row_scale, mask=head_ok)
        tl.store(dst_ptr + dst_off, rows.to(tl.int8), mask=ok)
        return
    if IS_FP8:
        scale = tl.load(scale_ptr + offs_h, mask=head_ok, other=1.0)
        # div_rn: IEEE division like torch's, not the GPU's default approximate fp32 divide.
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale[:, None]), -fp8_max, fp8_max)
    if ROUND_IN_FP32:
        # Round to the target grid (nearest, ties to even) in fp32 arithmetic: adding c = 1.5 * 2^23 * spacing
        # leaves exactly the bits the target keeps, so the narrowing cast below is exact. The exponent is
        # clamped so c stays finite for huge bf16 inputs (fp8 inputs are already within fp8_max).
        x = x.to(tl.float32)
        exp = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        exp = tl.minimum(tl.maximum(exp, MIN_NORMAL_EXP), 100)
        c = ((exp - MANTISSA_BITS + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
        rounded = (x + c) - c
        x = tl.where(rounded == 0.0, x * 0.0, rounded)  # x * 0 keeps the sign: -tiny -> -0, as torch stores it
    if IS_FP8:
        x = x.to(dst_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    else:
        x = x.to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + dst_off, x, mask=ok)


def triton_write_kv(
    key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor,
    *, round_in_fp32: bool | None = None,
) -> None:
    """key/value [T, Hkv, D] -> their slots in cache.k / cache.v (same contract as paged_attention.write_kv).

    round_in_fp32: pre-round to the cache dtype's grid in fp32 (None: only under the interpreter, whose
    fp32 -> fp8/bf16 casts round wrongly; compiled kernels use the hardware's correctly rounded conversion).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value need a contiguous last dim"
    assert key.dtype == value.dtype and cache.k.dtype == cache.v.dtype
    assert cache.k.stride() == cache.v.stride() and cache.k.stride(3) == 1, "K and V caches must share a layout"
    if round_in_fp32 is None:
        round_in_fp32 = INTERPRETED and (cache.dtype.is_fp8 or cache.dtype == KVDtype.BF16)
    is_int8 = cache.dtype.has_row_scales
    # The float grid's constants are unused for int8 (its rows are rounded to integers in fp32 anyway).
    finfo = torch.finfo(torch.float16 if is_int8 else cache.dtype.torch_dtype)
    # Non-int8 caches have no row scales: the per-head scales stand in for the unused pointers.
    k_rows, v_rows = (cache.k_row_scale, cache.v_row_scale) if is_int8 else (cache.k_scale, cache.v_scale)
    row_strides = cache.k_row_scale.stride() if is_int8 else (0, 0, 0)
    _kv_write_kernel[(num_tokens, 2)](
        key, value, cache.k, cache.v, cache.k_scale, cache.v_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2),
        cache.dtype.fp8_max if cache.dtype.is_fp8 else 0.0,
        k_rows, v_rows, *row_strides,
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=cache.k.shape[1],
        IS_FP8=cache.dtype.is_fp8, ROUND_IN_FP32=round_in_fp32 and not is_int8,
        MANTISSA_BITS=round(-math.log2(finfo.eps)), MIN_NORMAL_EXP=round(math.log2(finfo.smallest_normal)),
        IS_INT8=is_int8,
    )


# Triton builds every @triton.jit function under its interpreter when TRITON_INTERPRET=1 was set at import.
INTERPRETED = not isinstance(_kv_write_kernel, triton.runtime.JITFunction)
