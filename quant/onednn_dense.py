"""Dense fp32/bf16 weights pre-packed once for oneDNN: the CPU matmul path for unquantized layers.

Why: torch's `F.linear` on fp32 CPU tensors goes to MKL sgemm, which on AMD CPUs runs at about 40% of the
speed oneDNN's AVX-512 kernels reach on a weight already in their blocked layout (measured 2.3x at every
batch size from 1 to 2048 tokens on this machine; bf16 gains 10-50%, most at decode-sized batches). vLLM's
CPU backend takes the same route. The packed tensor is opaque (`torch._mkldnn` layout), so the plain
weight is dropped after packing: memory stays one copy of the weights.
"""

from __future__ import annotations

import functools

import torch

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN picks its blocking for this many rows; every other row count still runs at full speed (measured).
_BATCH_HINT = 64


def can_pack(weight: torch.Tensor) -> bool:
    """True on CPUs where torch was built with oneDNN and the weight is a dtype its packed GEMM serves here."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in _PACKABLE_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (weight.dtype != torch.bfloat16 or has_onednn_bf16())
    )


@functools.cache
def has_onednn_bf16() -> bool:
    """Whether torch multiplies bf16 through oneDNN here. Its bf16 GEMM needs AVX512-BW/VL/DQ or AVX-NE-CONVERT;
    on an AVX2-only host (AMD Zen 3, say) oneDNN refuses to pack, and F.linear in bf16 falls back to torch's
    reference kernel: 15-20 GFLOP/s on two Zen 3 cores at a small model's shapes, where fp32 ran 77-182
    (benchmarks/dense_gemm.py)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the same matrix in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    assert can_pack(weight), f"cannot pack a {weight.dtype} weight on {weight.device} for oneDNN"
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] -> [..., out] with a weight from `pack_weight`."""
    assert x.dtype == packed.dtype, f"activation {x.dtype} vs packed weight {packed.dtype}"
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])
