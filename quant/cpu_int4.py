"""CPU execution of 4-bit group-quantized linears with torch's own int4 kernels.

`aten._convert_weight_to_int4pack_for_cpu` takes q as int32 [N, K] in [0, 16) and returns the packed
uint8 [N, K/2]; `aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_and_zero)` computes
x @ W.T with W[n, k] = (q[n, k] - 8) * scale[k // group, n] + zero[k // group, n]. So a GPTQ/AWQ integer
zero point z becomes the float offset (8 - z) * scale (exact in fp32).

Constraints (torch 2.13): group in {32, 64, 128, 256}, N % 16 == 0, K divisible by the group. Groups
are mapped onto kernel blocks: a checkpoint group of 128 over K=576 (last group partial) runs with
64-wide blocks that repeat its scale; group_size -1 repeats one scale everywhere; act-order (g_idx a
permutation of groups) sorts the input channels once at load and permutes the activations per call.
"""

from __future__ import annotations

import torch

from pagedserve.quant.group_quant import GroupQuantWeight, QLinearKernel, sorted_groups
from pagedserve.quant.packing import unpack_cols, unpack_rows

KERNEL_GROUPS = (256, 128, 64, 32)
# torch 2.13's CPU int4 matmul only has a fast path for bfloat16 activations; float32 and float16 run a
# scalar fallback 25-300x slower than a dense fp32 matmul (benchmarks/quant_tools/bench_kernels.py), so
# those dtypes are left to the dequant kernel rather than silently computed in bfloat16.
SUPPORTED_DTYPES = (torch.bfloat16,)


def _int4_ops_available() -> bool:
    return hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu") and hasattr(
        torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def kernel_group(sorted_g: torch.Tensor) -> int | None:
    """Largest block size the kernel accepts such that every block lies inside one checkpoint group."""
    k = sorted_g.numel()
    for block in KERNEL_GROUPS:
        if k % block == 0 and bool((sorted_g.view(-1, block) == sorted_g.view(-1, block)[:, :1]).all()):
            return block
    return None


class CpuInt4Kernel(QLinearKernel):
    name = "cpu_int4"

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, perm: torch.Tensor | None,
                 block: int, in_features: int, out_features: int):
        super().__init__()
        self.block, self.in_features, self.out_features = block, in_features, out_features
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", scale_zero)
        self.register_buffer("perm", perm)

    @classmethod
    def unsupported_reason(cls, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cpu":
            return f"needs a CPU device, got {device.type}"
        if not _int4_ops_available():
            return "this torch build has no aten._weight_int4pack_mm_for_cpu"
        if w.bits != 4:
            return f"needs 4-bit weights, got {w.bits}-bit"
        if dtype not in SUPPORTED_DTYPES:
            return f"torch's CPU int4 kernel is only fast for bfloat16 activations, got {dtype} (use dtype=bfloat16)"
        if w.out_features % 16 != 0:
            return f"needs out_features % 16 == 0, got {w.out_features}"
        if kernel_group(sorted_groups(w.g_idx)[1]) is None:
            return f"no block size in {KERNEL_GROUPS} fits the groups of in_features={w.in_features}"
        return None

    @classmethod
    def from_weight(cls, w: GroupQuantWeight, dtype: torch.dtype = torch.bfloat16) -> "CpuInt4Kernel":
        """`dtype` is the activation dtype; float32/float16 work (used as references in tests) but are slow."""
        perm, sorted_g = sorted_groups(w.g_idx)
        block = kernel_group(sorted_g)
        assert block is not None
        q = unpack_rows(w.qweight, 4).t()  # [N, K]
        if perm is not None:
            q = q.index_select(1, perm)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        block_group = sorted_g[::block]  # checkpoint group of each kernel block
        z = unpack_cols(w.qzeros, 4).index_select(0, block_group).to(torch.float32)
        s = w.scales.index_select(0, block_group).to(torch.float32)
        scale_zero = torch.stack([s, (8.0 - z) * s], dim=-1).to(dtype).contiguous()  # [K/block, N, 2]
        perm32 = None if perm is None else perm.to(torch.int32)  # half the bytes of int64; index_select takes it
        return cls(packed, scale_zero, perm32, block, w.in_features, w.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 2 and x.shape[1] == self.in_features, (x.shape, self.in_features)
        out_dtype = x.dtype
        if x.dtype != self.scale_zero.dtype:
            x = x.to(self.scale_zero.dtype)
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.block, self.scale_zero)
        return y.to(out_dtype)
