"""The canonical packed layout GPTQ and AWQ convert to, the kernel interface that runs it, and the reference kernel.

Each format converts its checkpoint tensors once, at load, into `GroupQuantWeight` (the gptq_v2 layout: qweight
packed along the input dim, true zero points, g_idx); a `QLinearKernel` repacks that into whatever it multiplies
with. Weights stay packed: no kernel keeps a dequantized copy. `DequantKernel`, which dequantizes on every call, is
the reference and the fallback for shapes or bit widths the fast kernels cannot take. Kernel names and the `auto`
choice: qlinear_kernels.py.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from pagedserve.quant.base import QuantConfigError
from pagedserve.quant.native_linear import NativeLinear
from pagedserve.quant.packing import gptq_dequantize, pack_factor, pack_rows, unpack_cols, unpack_rows


@dataclass(frozen=True, slots=True)
class GroupQuantWeight:
    """W[out, in] = (q - z)[g_idx] * s[g_idx], transposed; q and z unsigned `bits`-bit integers."""

    qweight: torch.Tensor  # int32 [in / pf, out], field i of row r = input 8r+i (4-bit)
    qzeros: torch.Tensor  # int32 [groups, out / pf], true zero points (no v1 "-1")
    scales: torch.Tensor  # float [groups, out]
    g_idx: torch.Tensor  # int32 [in]
    bits: int
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        pf = pack_factor(self.bits)
        groups = self.scales.shape[0]
        expect = {"qweight": (self.in_features // pf, self.out_features),
                  "qzeros": (groups, self.out_features // pf),
                  "scales": (groups, self.out_features), "g_idx": (self.in_features,)}
        for name, shape in expect.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise QuantConfigError(name, f"canonical shape {got} != {shape}")

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return gptq_dequantize(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, 0, dtype)


def sorted_groups(g_idx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(perm or None, g_idx in kernel order): perm sorts input channels by group when g_idx is not
    already non-decreasing (act-order)."""
    g = g_idx.long()
    if g.numel() < 2 or bool((g[1:] >= g[:-1]).all()):
        return None, g
    perm = torch.argsort(g, stable=True)
    return perm, g.index_select(0, perm)


def run_block(sorted_g: torch.Tensor, min_block: int = 8) -> int | None:
    """Largest block size dividing every run of equal groups (so each block lies in one group), or
    None when that is below `min_block` (per-block scales would approach a dense tensor)."""
    _, counts = torch.unique_consecutive(sorted_g, return_counts=True)
    block = math.gcd(*counts.tolist()) if counts.numel() > 1 else int(counts[0])
    return block if block >= min_block else None


class QLinearKernel(nn.Module):
    """A packed weight in a kernel's own layout; forward: x [M, in] -> [M, out] (no bias)."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def unsupported_reason(cls, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when this kernel can run `w`; otherwise why not (logged when falling back)."""

    @classmethod
    @abstractmethod
    def from_weight(cls, w: GroupQuantWeight, dtype: torch.dtype) -> "QLinearKernel":
        ...

    def weight_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def native_linear(self, bias: torch.Tensor | None) -> NativeLinear | None:
        """This weight (plus `bias`) as a kernels/cpu/linear.h function for the native decode step, or None where
        the kernel has no C entry (the step then keeps the model on the torch path)."""
        return None


class DequantKernel(QLinearKernel):
    """Keeps the weight packed and dequantizes it on every call, then a dense matmul: the fallback for
    what the fast kernels cannot take (8-bit, float32 activations on CPU, odd shapes).

    Prepared once: input rows sorted by group (act-order permutes the activations instead) and cut into
    blocks of `block` rows, each inside one group, so a call is an unpack, one fused multiply-subtract
    with per-block scale and scale*zero, and the matmul. Irregular groupings use g_idx per row."""

    name = "dequant"

    def __init__(self, w: GroupQuantWeight):
        super().__init__()
        self.bits, self.in_features, self.out_features = w.bits, w.in_features, w.out_features
        perm, sorted_g = sorted_groups(w.g_idx)
        self.block = run_block(sorted_g)
        if self.block is None:
            self.register_buffer("perm", None)
            for field in ("qweight", "qzeros", "scales", "g_idx"):
                self.register_buffer(field, getattr(w, field))
            return
        q = unpack_rows(w.qweight, w.bits)
        self.register_buffer("perm", None if perm is None else perm.to(torch.int32))
        self.register_buffer("qweight", pack_rows(q if perm is None else q.index_select(0, perm), w.bits))
        # Per group, not per block: a partial last group would otherwise double the scale bytes.
        self.register_buffer("block_group", sorted_g[:: self.block].to(torch.int32))
        self.register_buffer("scales", w.scales)
        self.register_buffer("qzeros", w.qzeros)

    @classmethod
    def unsupported_reason(cls, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        return None

    @classmethod
    def from_weight(cls, w: GroupQuantWeight, dtype: torch.dtype) -> "DequantKernel":
        return cls(w)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W.T [in (sorted by group), out]; transient, never stored."""
        if self.block is None:
            return GroupQuantWeight(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits,
                                    self.in_features, self.out_features).dequantize(dtype).t()
        scale = self.scales.index_select(0, self.block_group).to(torch.float32)  # [K / block, N]
        zero = unpack_cols(self.qzeros, self.bits).index_select(0, self.block_group)
        scaled_zero = zero.to(torch.float32) * scale  # exact: fp16 scale x small integer
        q = unpack_rows(self.qweight, self.bits).view(-1, self.block, self.out_features)
        w = torch.addcmul(-scaled_zero.unsqueeze(1), q.to(torch.float32), scale.unsqueeze(1))
        return w.view(self.in_features, self.out_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 2 and x.shape[1] == self.in_features, (x.shape, self.in_features)
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        return torch.mm(x, self.dense_weight(x.dtype))
