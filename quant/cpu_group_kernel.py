"""GPTQ/AWQ on CPU through the native group kernel (kernels/cpu/group_linear.c): the `cpu_group` QLinearKernel.

The canonical GroupQuantWeight is repacked once into the kernel's layout (kernels/cpu/group_packed.py: input
channels sorted by group, 32 per run, nibbles of a run side by side, per-row scales and zeros; then, where the build
has AVX2 or AVX-512 and out_features % 16 == 0, output rows interleaved in groups of 16, kernels/cpu/group_grouped.c) and the
checkpoint's tensors are dropped, so the layer holds only those bytes. Calls of up to `NATIVE_MAX_ROWS` rows
(decode) multiply in place with fp32 activations; more rows (prefill) expand the matrix per call into the compute
dtype and take a dense GEMM, whose AMX/AVX-512 tiles win there. The same matrix is the layer's `NativeLinear`, so
GPTQ/AWQ models take the native decode step.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu.group_packed import FAST_GROUP_GROUPED_ISAS, GroupMatrix
from pagedserve.kernels.cpu.native import NativeBuildError
from pagedserve.kernels.cpu.packed import GROUP_ROWS, build, group_grouped_isa
from pagedserve.quant.group_quant import GroupQuantWeight, QLinearKernel, sorted_groups
from pagedserve.quant.native_linear import DEFAULT_NATIVE_MAX_BATCH, NativeLinear, grouped_native_max_batch
from pagedserve.quant.packing import unpack_cols, unpack_rows

NATIVE_MAX_ROWS = 8
RUN = 32  # input channels per run: each run lies in one group


def _runs_in_groups(sorted_g: torch.Tensor) -> bool:
    runs = sorted_g.view(-1, RUN)
    return bool((runs == runs[:, :1]).all())


def repack(w: GroupQuantWeight, bias: torch.Tensor | None = None, group_rows: bool = True) -> GroupMatrix:
    """The canonical weight in the kernel's layout (see kernels/cpu/group_linear.c), with its rows interleaved
    (kernels/cpu/group_grouped.c) when `group_rows`, out_features % GROUP_ROWS == 0 and the build's interleaved kernel is
    one of FAST_GROUP_GROUPED_ISAS (the portable one is slower than the row-after-row one); raises ValueError when it cannot be repacked."""
    if w.in_features % RUN:
        raise ValueError(f"in_features: {w.in_features} is not a multiple of {RUN}")
    perm, sorted_g = sorted_groups(w.g_idx)
    if not _runs_in_groups(sorted_g):
        raise ValueError(f"g_idx: some run of {RUN} group-sorted inputs spans two groups")
    q = unpack_rows(w.qweight, w.bits)  # [in, out]
    if perm is not None:
        q = q.index_select(0, perm)
    q = q.t().to(torch.uint8)  # [out, in]
    if w.bits == 4:
        pairs = q.reshape(w.out_features, -1, 2, RUN // 2)  # each run: values 0-15 low nibbles, 16-31 high
        q = pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)
    scales = w.scales if w.scales.dtype in (torch.float16, torch.float32) else w.scales.float()
    matrix = GroupMatrix(
        bits=w.bits, codes=q.reshape(w.out_features, -1).contiguous(), scales=scales.t().contiguous(),
        zeros=unpack_cols(w.qzeros, w.bits).t().to(torch.uint8).contiguous(),
        run_group=sorted_g[::RUN].to(torch.int32).contiguous(),
        perm=None if perm is None else perm.to(torch.int32).contiguous(),
        bias=None if bias is None else bias.detach().float().contiguous())
    if group_rows and w.out_features % GROUP_ROWS == 0 and group_grouped_isa(matrix.lib) in FAST_GROUP_GROUPED_ISAS:
        return matrix.grouped()
    return matrix


class CpuGroupKernel(QLinearKernel):
    name = "cpu_group"

    def __init__(self, matrix: GroupMatrix):
        super().__init__()
        self.matrix = matrix
        self.in_features, self.out_features = matrix.in_features, matrix.out_features
        # Integer buffers only: Module.to(dtype) converts floating-point buffers, which would leave the C state
        # pointing at freed scales; they stay with the matrix (and count in weight_nbytes).
        for field in ("codes", "zeros", "run_group", "perm"):
            self.register_buffer(field, getattr(matrix, field))

    @classmethod
    def unsupported_reason(cls, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cpu":
            return f"needs a CPU device, got {device.type}"
        if w.in_features % RUN:
            return f"needs in_features % {RUN} == 0, got {w.in_features}"
        if not _runs_in_groups(sorted_groups(w.g_idx)[1]):
            return f"some run of {RUN} group-sorted inputs spans two groups"
        try:
            build()
        except NativeBuildError as exc:
            return f"native kernels unavailable: {exc}"
        return None

    @classmethod
    def from_weight(cls, w: GroupQuantWeight, dtype: torch.dtype) -> "CpuGroupKernel":
        return cls(repack(w))

    def weight_nbytes(self) -> int:
        return self.matrix.nbytes()

    def native_linear(self, bias: torch.Tensor | None) -> NativeLinear:
        """The layer (with its bias) as a `ps_linear` for the native decode step."""
        m = self.matrix
        if bias is not None:
            m = dataclasses.replace(m, bias=bias.detach().float().contiguous())
        # grouped rows: the same one-pass-for-8-rows structure as the GGUF grouped kernel (quant/gguf.py)
        limit = grouped_native_max_batch(group_grouped_isa(m.lib)) if m.row_group else DEFAULT_NATIVE_MAX_BATCH
        return NativeLinear(m.linear_fn, m.state_address, m.in_features, m.out_features, (m,), limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 2 and x.shape[1] == self.in_features, (x.shape, self.in_features)
        if x.shape[0] <= NATIVE_MAX_ROWS:
            return self.matrix.matmul(x.float().contiguous()).to(x.dtype)
        dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        xs = x if self.perm is None else x.index_select(1, self.perm)
        return F.linear(xs.to(dtype), self.matrix.dequantize(dtype)).to(x.dtype)
