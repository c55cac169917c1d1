"""Long prefill chunks through a GGUF layer that holds nothing but its blocks, on hosts with AMX tiles: the matrix
dequantized per call into a bf16 scratch (kernels/cpu/packed_grouped_bf16.c), then torch's bf16 GEMM (oneDNN, AMX).

Why: on the AVX-512 tiers the packed many-row kernel (kernels/cpu/packed_grouped_panel16.h) runs at the int16 pair
dots' rate, ~150-220 GFLOP/s per core on a Sapphire Rapids core; AMX tiles multiply bf16 at 400-1100 from a few
dozen rows on, and dequantizing a matrix from its interleaved tiles costs ~3-7 G weights/s per core, so from
`MIN_ROWS` rows on the per-call expansion wins (benchmarks/packed_prefill.py --per-call: docs/quantization.md).
Without AMX (Zen 4, VMs that refuse tile state) oneDNN's AVX512-BF16 GEMM ran below the packed kernel, which then
serves every row count. The scratch is a temporary of at most `SLAB_BYTES` (a larger matrix, an LM head, goes in
slabs): the heap reuses it from call to call (engine/host/allocator.py), and no layer keeps an expanded copy.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu.packed import GROUP_ROWS, PackedMatrix, grouped_bf16_available

MIN_ROWS = 64  # rows from which the per-call expansion beat the packed kernel on the 1B and SmolLM2 shapes
SLAB_BYTES = 64 << 20  # most bf16 scratch per GEMM: a 1B model's gate_up whole, an LM head in slabs


@functools.cache
def _amx_granted() -> bool:
    from pagedserve.kernels.cpu.native import NativeBuildError
    from pagedserve.quant.dense_native import gemm_isa

    try:
        return gemm_isa() == "amx"
    except NativeBuildError:
        return False


def takes(packed: PackedMatrix, rows: int, dtype: torch.dtype) -> bool:
    """Whether a call of `rows` rows in `dtype` goes through `dequantized_linear`: bf16 compute, a grouped matrix,
    an AVX512-BF16 build of the packed library and AMX tiles granted to this process."""
    return (rows >= MIN_ROWS and dtype == torch.bfloat16 and bool(packed.row_group)
            and grouped_bf16_available(packed.lib) and _amx_granted())


def dequantized_linear(packed: PackedMatrix, x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] bf16 @ W^T + bias in bf16, W (a grouped matrix) dequantized per call, slab by slab."""
    out, inn = packed.out_features, packed.in_features
    slab = min(out, max(GROUP_ROWS, SLAB_BYTES // (2 * inn) // GROUP_ROWS * GROUP_ROWS))
    scratch = torch.empty(slab, inn, dtype=torch.bfloat16)
    bias = None if packed.bias is None else packed.bias.to(x.dtype)
    if slab == out:
        packed.dequantize_grouped_bf16(0, out, scratch, row_major=True)
        return F.linear(x, scratch, bias)
    y = torch.empty(x.shape[0], out, dtype=x.dtype)
    for o0 in range(0, out, slab):
        o1 = min(out, o0 + slab)
        packed.dequantize_grouped_bf16(o0, o1, scratch[:o1 - o0], row_major=True)
        y[:, o0:o1] = F.linear(x, scratch[:o1 - o0], None if bias is None else bias[o0:o1])
    return y
