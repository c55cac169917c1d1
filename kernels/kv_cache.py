"""KV-cache storage: the dtype of its blocks, its geometry, and the per-layer tensors plus scales."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass

import torch

from pagedserve.kernels import huge_pages


class KVCacheConfigError(ValueError):
    """A KV-cache setting is invalid; the message names the field."""


class KVDtype(enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"  # one fp16 scale per token and KV head beside each row, set when the row is written

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def is_fp8(self) -> bool:
        return self in (KVDtype.FP8_E4M3, KVDtype.FP8_E5M2)

    @property
    def has_row_scales(self) -> bool:
        """Rows carry their own scale (int8): per-layer k/v scales are unused, nothing is calibrated."""
        return self is KVDtype.INT8

    @property
    def is_8bit(self) -> bool:
        """Stored in 8 bits (FP8 or int8) and dequantized on every read, unlike the 16-bit caches."""
        return self.is_fp8 or self.has_row_scales

    @property
    def row_bytes_extra(self) -> int:
        """Bytes per row (token and KV head) beyond its elements: the fp16 row scale."""
        return ROW_SCALE_DTYPE.itemsize if self.has_row_scales else 0

    @property
    def fp8_max(self) -> float:
        """Largest finite value; stores clamp to it so CPU (saturating) and GPU agree."""
        if not self.is_fp8:
            raise KVCacheConfigError("kv_cache_dtype", f"{self.value} is not an fp8 dtype")
        return float(torch.finfo(self.torch_dtype).max)

    @classmethod
    def parse(cls, name: str, model_dtype: torch.dtype) -> "KVDtype":
        """`auto` follows the model's dtype; `fp8` is vLLM's spelling of fp8_e4m3; anything else must be one of the
        listed names."""
        name = ALIASES.get(name, name)
        if name == "auto":
            for kv, td in _TORCH_DTYPES.items():
                if td == model_dtype and not kv.is_fp8:
                    return kv
            raise KVCacheConfigError("kv_cache_dtype", f"no KV dtype matches model dtype {model_dtype}")
        try:
            return cls(name)
        except ValueError:
            supported = ", ".join(["auto", *ALIASES] + [k.value for k in cls])
            raise KVCacheConfigError("kv_cache_dtype", f"unknown {name!r}; supported: {supported}") from None


_TORCH_DTYPES = {
    KVDtype.FP32: torch.float32,
    KVDtype.FP16: torch.float16,
    KVDtype.BF16: torch.bfloat16,
    KVDtype.FP8_E4M3: torch.float8_e4m3fn,
    KVDtype.FP8_E5M2: torch.float8_e5m2,
    KVDtype.INT8: torch.int8,
}
ALIASES = {"fp8": KVDtype.FP8_E4M3.value}  # vLLM's --kv-cache-dtype fp8
ROW_SCALE_DTYPE = torch.float16  # int8 rows' scales: 2 bytes per row (a fp32 one would drop 64-dim heads below 1.9x)
INT8_MAX = 127  # symmetric: -128 is never stored, so negation is exact


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Geometry of the paged cache; one block holds `block_size` tokens of K and V for every layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: KVDtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise KVCacheConfigError(name, f"must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer; int8 rows count their fp16 scale."""
        row = self.head_dim * self.dtype.itemsize + self.dtype.row_bytes_extra
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * row

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block


@dataclass(slots=True)
class LayerKVCache:
    """One layer's blocks. k/v: [num_blocks, block_size, num_kv_heads, head_dim] (logical shape).

    KVCache stores them head-major, [num_kv_heads, num_blocks, block_size, head_dim], and hands out the permuted
    view: kernels that address by strides see the logical shape, while `by_head` gives the torch path contiguous
    per-head tiles, so one index_select yields a sequence's K as [Hkv, L, D], ready for a matmul.

    k_scale/v_scale: [num_kv_heads] fp32, the dequantization scales (stored = real / scale).
    A per-tensor scale is the same value repeated; non-fp8 caches keep ones and ignore them.
    k_rotation: an orthogonal [head_dim, head_dim] matrix R, or None. When set, the entry points store K @ R and
    attend with Q @ R (Q.K is unchanged), which spreads K's outlier channels before FP8 rounding.
    k_offset: [num_kv_heads, head_dim] fp32 subtracted from K (after the rotation) before it is stored, or None.
    Attention reads K - m as it is: Q.(K - m) = Q.K - Q.m shifts every score of a query by the same amount, which
    softmax ignores, so only FP8's rounding sees the smaller values.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    dtype: KVDtype
    k_rotation: torch.Tensor | None = None
    k_offset: torch.Tensor | None = None
    # int8 only: [num_blocks, block_size, num_kv_heads] fp16 row scales (a view of head-major
    # [num_kv_heads, num_blocks, block_size] storage, like k/v); row (slot, head) holds q * scale.
    k_row_scale: torch.Tensor | None = None
    v_row_scale: torch.Tensor | None = None

    @staticmethod
    def by_head(cache_tensor: torch.Tensor) -> torch.Tensor:
        """k or v -> the head-major storage [num_kv_heads, num_blocks, block_size, head_dim] (no copy)."""
        storage = cache_tensor.permute(2, 0, 1, 3)
        assert storage.is_contiguous(), "KV cache tensors must come from KVCache (head-major storage)"
        return storage

    @staticmethod
    def scales_by_head(row_scale: torch.Tensor) -> torch.Tensor:
        """k_row_scale or v_row_scale -> the head-major storage [num_kv_heads, num_blocks, block_size] (no copy)."""
        storage = row_scale.permute(2, 0, 1)
        assert storage.is_contiguous(), "row scales must come from KVCache (head-major storage)"
        return storage


def _line_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of shape and dtype, rounded up to whole 64-byte lines."""
    return -(-math.prod(shape) * dtype.itemsize // 64) * 64


class KVCache:
    """All layers' blocks, allocated once from the spec."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu"):
        if num_blocks < 1:
            raise KVCacheConfigError("kv_cache_memory", f"budget yields {num_blocks} blocks; need at least 1")
        self.spec = spec
        self.num_blocks = num_blocks
        storage = (spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim)
        scales = storage[:3] if spec.dtype.has_row_scales else None
        # One buffer for every layer's K, V (and row scales), each piece on a 64-byte line: on CPU it is on huge
        # pages (kernels/huge_pages.py), which decode attention's scattered tile reads need.
        pieces = [(storage, spec.dtype.torch_dtype)] * 2 + ([(scales, ROW_SCALE_DTYPE)] * 2 if scales else [])
        sizes = [_line_bytes(shape, dtype) for shape, dtype in pieces]
        arena = huge_pages.zeroed_bytes(sum(sizes) * spec.num_layers, device)
        offsets = itertools.accumulate([0] + sizes * spec.num_layers)  # each piece's start, end to end
        ones = lambda: torch.ones(spec.num_kv_heads, dtype=torch.float32, device=device)  # noqa: E731

        def piece(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            view = huge_pages.carve(arena, next(offsets), shape, dtype)
            return view.permute(1, 2, 0, 3) if len(shape) == 4 else view.permute(1, 2, 0)

        self.layers = []
        for _ in range(spec.num_layers):
            k, v = piece(storage, spec.dtype.torch_dtype), piece(storage, spec.dtype.torch_dtype)
            k_rows = piece(scales, ROW_SCALE_DTYPE) if scales else None
            v_rows = piece(scales, ROW_SCALE_DTYPE) if scales else None
            self.layers.append(LayerKVCache(k=k, v=v, k_scale=ones(), v_scale=ones(), dtype=spec.dtype,
                                            k_row_scale=k_rows, v_row_scale=v_rows))

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block dst[i] of every layer becomes a copy of block src[i] (copy-on-write), row scales included."""
        for layer in self.layers:
            for cache in (layer.k, layer.v, layer.k_row_scale, layer.v_row_scale):
                if cache is not None:
                    raw = cache.view(torch.uint8) if cache.dtype.itemsize == 1 else cache
                    raw[dst] = raw[src]

    def set_k_rotation(self, rotation: torch.Tensor | None) -> None:
        """Install one orthogonal [head_dim, head_dim] K rotation for every layer (None removes it)."""
        if rotation is not None:
            d = self.spec.head_dim
            if rotation.shape != (d, d):
                raise KVCacheConfigError("k_rotation", f"shape {tuple(rotation.shape)}, expected ({d}, {d})")
            rotation = rotation.to(device=self.layers[0].k.device, dtype=torch.float32)
        for entry in self.layers:
            entry.k_rotation = rotation

    def set_scales(self, layer: int, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Install per-tensor (scalar) or per-KV-head ([num_kv_heads]) scales for one layer."""
        entry = self.layers[layer]
        for name, src, dst in (("k_scale", k_scale, entry.k_scale), ("v_scale", v_scale, entry.v_scale)):
            src = src.detach().to(torch.float32).reshape(-1)
            if src.numel() not in (1, dst.numel()):
                raise KVCacheConfigError(name, f"layer {layer}: {src.numel()} values, expected 1 or {dst.numel()}")
            if not bool(torch.isfinite(src).all()) or bool((src <= 0).any()):
                raise KVCacheConfigError(name, f"layer {layer}: scales must be finite and > 0")
            dst.copy_(src.expand_as(dst))
