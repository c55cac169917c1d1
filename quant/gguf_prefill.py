"""Long prefill chunks through a GGUF layer that holds nothing but its blocks: dequantized per call, a slab of
output rows at a time, into a small bf16 scratch in the grouped layout kernels/cpu/dense_gemm.c reads.

Why: on the AVX-512 tiers the packed many-row kernel (kernels/cpu/packed_grouped_panel16.h) runs at the int16 pair
dots' rate, while AMX tiles multiply bf16 several times faster; past a few hundred rows a matrix's dequantization
(kernels/cpu/packed_grouped_bf16.c) costs less than the difference. The scratch is a slab (`SLAB_BYTES`), not the
matrix: it stays in cache for the GEMM, and no layer keeps an expanded copy.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.packed import PackedMatrix
from pagedserve.quant.dense_layout import GROUP_ROWS
from pagedserve.quant.dense_native import dense_gemm, dense_native_linear

SLAB_BYTES = 4 << 20  # bf16 weights dequantized per GEMM call


def dequantized_gemm(packed: PackedMatrix, x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] (fp32 or bf16) @ W^T + bias, in x's dtype, W (a grouped matrix) dequantized slab by slab."""
    out, inn = packed.out_features, packed.in_features
    slab = min(out, max(GROUP_ROWS, SLAB_BYTES // (2 * inn) // GROUP_ROWS * GROUP_ROWS))
    scratch = torch.empty(slab, inn, dtype=torch.bfloat16)
    scratch.pagedserve_row_group = GROUP_ROWS  # what dense_native_linear reads the layout from
    y = torch.empty(x.shape[0], out, dtype=x.dtype)
    for o0 in range(0, out, slab):
        o1 = min(out, o0 + slab)
        w = scratch[:o1 - o0]
        w.pagedserve_row_group = GROUP_ROWS
        packed.dequantize_grouped_bf16(o0, o1, w)
        bias = None if packed.bias is None else packed.bias[o0:o1]
        y[:, o0:o1] = dense_gemm(dense_native_linear(w, bias), x)
    return y
