"""Vendor CUDA kernels, used when their package is installed (optional imports, never required).

Currently: AutoAWQ's `awq_ext.gemm_forward_cuda` (package autoawq-kernels), for 4-bit fp16 layers
whose groups are uniform and contiguous after the act-order sort. The canonical weight is repacked once
into AWQ's interleaved layout. Not exercised in CI (no GPU, no wheel); the Triton kernel is the tested
CUDA path and the fallback.
"""

from __future__ import annotations

import importlib.util

import torch

from pagedserve.quant.group_quant import GroupQuantWeight, QLinearKernel, sorted_groups
from pagedserve.quant.packing import pack_awq, unpack_cols, unpack_rows


def _awq_ext_available() -> bool:
    return importlib.util.find_spec("awq_ext") is not None


def uniform_group_size(sorted_g: torch.Tensor, groups: int) -> int | None:
    """K / groups when group j is exactly rows [j*gs, (j+1)*gs) of the sorted order, else None."""
    k = sorted_g.numel()
    if k % groups:
        return None
    gs = k // groups
    expect = torch.arange(k, device=sorted_g.device) // gs
    return gs if bool((sorted_g == expect).all()) else None


class AwqExtKernel(QLinearKernel):
    name = "vendor"
    SPLIT_K_ITERS = 8

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 perm: torch.Tensor | None, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        self.register_buffer("perm", perm)

    @classmethod
    def unsupported_reason(cls, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return f"needs a CUDA device, got {device.type}"
        if not _awq_ext_available():
            return "awq_ext (autoawq-kernels) is not installed"
        if w.bits != 4 or dtype != torch.float16:
            return f"awq_ext needs 4-bit weights and float16 activations, got {w.bits}-bit {dtype}"
        if w.out_features % 64 or w.in_features % 64:
            return f"awq_ext needs in/out features divisible by 64, got {w.in_features}/{w.out_features}"
        if uniform_group_size(sorted_groups(w.g_idx)[1], w.scales.shape[0]) is None:
            return "groups are not uniform (partial last group or uneven act-order groups)"
        return None

    @classmethod
    def from_weight(cls, w: GroupQuantWeight, dtype: torch.dtype) -> "AwqExtKernel":
        perm, _ = sorted_groups(w.g_idx)
        q = unpack_rows(w.qweight, 4)  # [K, N]
        if perm is not None:
            q = q.index_select(0, perm)
        zeros = unpack_cols(w.qzeros, 4)
        return cls(pack_awq(q), pack_awq(zeros), w.scales.to(torch.float16).contiguous(), perm,
                   w.in_features, w.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import awq_ext

        assert x.dim() == 2 and x.shape[1] == self.in_features and x.dtype == torch.float16, (x.shape, x.dtype)
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        return awq_ext.gemm_forward_cuda(x.contiguous(), self.qweight, self.scales, self.qzeros,
                                         self.SPLIT_K_ITERS)
