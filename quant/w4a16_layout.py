"""The decode kernel's weight layout: GPTQ/AWQ weights repacked once, at load, on the weight's device.

From the canonical `GroupQuantWeight` (both formats convert to it: AWQ's interleaved output packing is undone there):
- input rows sorted by group (act-order) so every group is a contiguous run of `group_size` rows, the last one
  possibly shorter; the permutation is kept and the activation is permuted once per call instead of the weight;
- qweight int32 [K / pf, N], packed along K with N contiguous: one program's load of a [K tile, N tile] of words is
  coalesced along N and each word is unpacked by broadcast shifts into pf consecutive K rows;
- scales and zeros [groups, N], both in the scales' float dtype (integer zeros <= 255 are exact in fp16 and bf16):
  a program loads them once per group and column tile. The zero is applied per group as `sum(x) * z` after the
  tile's dot product, so the inner loop multiplies raw integers and folding -z*s into the weight saves nothing.

Layouts whose sorted groups are not uniform runs (hand-made g_idx) are refused with a reason; the caller falls back
to the per-element Triton kernel (triton_gemm.py), which looks each row's group up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.quant.group_quant import GroupQuantWeight, sorted_groups
from pagedserve.quant.packing import pack_factor, pack_rows, unpack_cols, unpack_rows

# The K tile must lie inside one group and feed a 16-row tl.dot, so a group's length is a multiple of this.
MIN_GROUP_MULTIPLE = 16


@dataclass(frozen=True, slots=True)
class DecodeLayout:
    qweight: torch.Tensor  # int32 [K / pf, N], K rows in group order
    scales: torch.Tensor  # float [groups, N]
    zeros: torch.Tensor  # float [groups, N], integer-valued zero points, same dtype as scales
    perm: torch.Tensor | None  # int64 [K]: x[:, perm] is the activation in the weight's K order; None if sorted
    bits: int
    group_size: int  # rows per group in sorted order; K for one group
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        k, n, pf = self.in_features, self.out_features, pack_factor(self.bits)
        groups = -(-k // self.group_size)
        if tuple(self.qweight.shape) != (k // pf, n) or tuple(self.scales.shape) != (groups, n) \
                or self.zeros.shape != self.scales.shape:
            raise ValueError(f"decode layout shapes {tuple(self.qweight.shape)}, {tuple(self.scales.shape)}, "
                             f"{tuple(self.zeros.shape)} do not fit K={k} N={n} group {self.group_size}")

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in sorted K order (torch reference of what the kernel computes)."""
        g = torch.arange(self.in_features, device=self.qweight.device) // self.group_size
        q = unpack_rows(self.qweight, self.bits).to(torch.float32)
        w = (q - self.zeros.float().index_select(0, g)) * self.scales.float().index_select(0, g)
        return w.t().to(dtype)


def uniform_run(sorted_g: torch.Tensor) -> int | None:
    """The group length when group j is exactly sorted rows [j*g, (j+1)*g) (the last run may be shorter), else None."""
    k = sorted_g.numel()
    first = int((sorted_g == sorted_g[0]).sum())
    expect = torch.arange(k, device=sorted_g.device) // first
    return first if int(sorted_g[0]) == 0 and bool((sorted_g == expect).all()) else None


def unsupported_reason(w: GroupQuantWeight) -> str | None:
    _, sorted_g = sorted_groups(w.g_idx)
    run = uniform_run(sorted_g)
    if run is None:
        return "its groups are not uniform contiguous runs after sorting by g_idx"
    if run != w.in_features and run % MIN_GROUP_MULTIPLE:
        return f"group size {run} is not a multiple of {MIN_GROUP_MULTIPLE}"
    if w.scales.shape[0] != -(-w.in_features // run):
        return f"{w.scales.shape[0]} scale groups for {-(-w.in_features // run)} used ones"
    return None


def repack(w: GroupQuantWeight) -> DecodeLayout:
    """The canonical weight in the decode layout, on the weight's device (call unsupported_reason first)."""
    perm, sorted_g = sorted_groups(w.g_idx)
    run = uniform_run(sorted_g)
    assert run is not None, "repack needs uniform groups: check unsupported_reason first"
    qweight = w.qweight
    if perm is not None:
        qweight = pack_rows(unpack_rows(w.qweight, w.bits).index_select(0, perm), w.bits)
    zeros = unpack_cols(w.qzeros, w.bits).to(w.scales.dtype)
    return DecodeLayout(qweight=qweight.contiguous(), scales=w.scales.contiguous(), zeros=zeros.contiguous(),
                        perm=perm, bits=w.bits, group_size=run, in_features=w.in_features,
                        out_features=w.out_features)
