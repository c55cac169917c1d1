"""Moving K/V between compute dtypes and the cache's storage in torch: quantize + store, gather + dequantize.

Shared by the torch and native implementations (and the reference the Triton and C kernels are tested against).

int8 rows (one fp16 scale per token and KV head, written beside the row): scale = fp16(amax(|x|) / 127), computed
in fp32 and rounded once; stored = clamp(rint(x / scale), -127, 127) with fp32 IEEE division and round-half-even;
x = stored * scale. A row of zeros (or one whose scale underflows fp16) stores scale 0 and zeros. Every kernel
(the C write, the Triton write) reproduces these bytes exactly.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.kv_cache import INT8_MAX, ROW_SCALE_DTYPE, KVDtype, LayerKVCache

_FP16_MAX = float(torch.finfo(ROW_SCALE_DTYPE).max)


def quantize_for_cache(x: torch.Tensor, scale: torch.Tensor, dtype: KVDtype) -> torch.Tensor:
    """x [T, Hkv, D] -> cache dtype. FP8 divides by the per-head scale and clamps to the finite range."""
    if not dtype.is_fp8:
        return x.to(dtype.torch_dtype)
    limit = dtype.fp8_max
    scaled = x.float() / scale.view(1, -1, 1)
    return scaled.clamp_(-limit, limit).to(dtype.torch_dtype)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 rows [..., D], fp16 row scales [...]): each row's amax maps to 127."""
    xf = x.float()
    # fp16's largest scale covers |x| up to 8.3e6; beyond it rows saturate rather than store inf.
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).clamp_(max=_FP16_MAX).to(ROW_SCALE_DTYPE)
    divisor = scale.float().unsqueeze(-1)
    scaled = torch.where(divisor > 0, xf / divisor, torch.zeros_like(xf))
    return scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


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
    """x in cache dtype, KV heads along `head_axis` ([..., Hkv, D] by default) -> out_dtype, FP8 times its head's scale.
    int8 rows: `scale` is their row scales, shaped like x without its last dim."""
    if dtype.has_row_scales:
        # int8 x fp16 is exact in fp32: the one rounding is to out_dtype, as for FP8.
        return (x.float() * scale.float().unsqueeze(-1)).to(out_dtype)
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


def _store_scales(row_scale: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor) -> None:
    """scales [T, Hkv] -> their slots of the head-major [Hkv, num_blocks, block_size] row-scale storage."""
    storage = LayerKVCache.scales_by_head(row_scale)
    storage.view(storage.shape[0], -1)[:, slots] = scales.transpose(0, 1)


def store_kv(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """key, value [T, Hkv, D] -> their cache slots, quantized to the cache's dtype."""
    if cache.dtype.has_row_scales:
        for x, tensor, row_scale in ((key, cache.k, cache.k_row_scale), (value, cache.v, cache.v_row_scale)):
            rows, scales = quantize_rows_int8(x)
            _store(tensor, slot_mapping, rows)
            _store_scales(row_scale, slot_mapping, scales)
        return
    _store(cache.k, slot_mapping, quantize_for_cache(key, cache.k_scale, cache.dtype))
    _store(cache.v, slot_mapping, quantize_for_cache(value, cache.v_scale, cache.dtype))


def head_tiles(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """block_ids [N] -> rows [Hkv * N] of the storage viewed as [Hkv * num_blocks, block_size, D], head-major."""
    heads = torch.arange(num_kv_heads, device=block_ids.device, dtype=torch.long)
    return (heads[:, None] * num_blocks + block_ids[None, :]).reshape(-1)


def gather_kv(cache: LayerKVCache, tiles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """tiles [Hkv * N] -> K, V [Hkv, N * block_size, D] in `dtype` (index_select of whole tiles: a row copy)."""
    out = []
    for tensor, scale, row_scale in ((cache.k, cache.k_scale, cache.k_row_scale),
                                     (cache.v, cache.v_scale, cache.v_row_scale)):
        storage = LayerKVCache.by_head(tensor)
        num_kv_heads, _, block_size, head_dim = storage.shape
        picked = storage.view(-1, block_size, head_dim).index_select(0, tiles).view(num_kv_heads, -1, head_dim)
        if row_scale is not None:
            scale = LayerKVCache.scales_by_head(row_scale).view(-1, block_size).index_select(0, tiles)
            scale = scale.view(num_kv_heads, -1)
        out.append(dequantize_from_cache(picked, scale, cache.dtype, dtype, head_axis=0))
    return out[0], out[1]
