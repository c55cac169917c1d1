"""The elementwise math of a decoder layer (RMSNorm, residual add, SiLU-and-mul, RoPE), behind one small interface.

`torch` is transformers' op order, bit for bit (the fp32 engine's greedy output must equal transformers'). `native`
runs the same math fused in C (kernels/cpu_layer_ops.c) for 16-bit dtypes on CPU, where torch's separate small
ops cost ~15% of a decode step; fp32 stays on torch so its results stay bit-identical to the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_layer_ops, cpu_native
from pagedserve.kernels.registry import Registry

# fp32 stays on torch: its results must stay bit-identical to transformers'.
NATIVE_DTYPES = (torch.bfloat16, torch.float16)


class TorchLayerOps:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm, so fp32 results are bit-identical.
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual + delta, RMSNorm of that sum). The native version updates `residual` in place."""
        total = residual + delta
        return total, self.rms_norm(total, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x [T, N, D] -> (x * cos) + (rotate_half(x) * sin), transformers' op order; sin arrives sign-folded."""
        tokens, heads, dim = x.shape
        swapped = x.reshape(tokens, heads, 2, dim // 2).flip(2).view(tokens, heads, dim)  # [x2, x1]
        return x * cos + swapped * signed_sin


class NativeLayerOps(TorchLayerOps):
    """C kernels for contiguous 16-bit CPU tensors; anything else takes the torch ops."""

    def __init__(self) -> None:
        cpu_native.load_library()  # asked for by name, a missing compiler is an error, not a silent fallback

    @staticmethod
    def _native(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in NATIVE_DTYPES

    @classmethod
    def _native_rows(cls, x: torch.Tensor) -> bool:
        """A dense [tokens, width] tensor the row kernels can take as is."""
        return cls._native(x) and x.dim() == 2 and x.is_contiguous()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._native_rows(x):
            return cpu_layer_ops.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, residual, delta, weight, eps):
        if self._native_rows(residual) and delta.is_contiguous():
            return residual, cpu_layer_ops.rms_norm(residual, weight, eps, delta=delta)
        return super().add_rms_norm(residual, delta, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._native_rows(gate_up):
            return cpu_layer_ops.silu_and_mul(gate_up)
        return super().silu_and_mul(gate_up)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        if self._native(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            return cpu_layer_ops.rope(x, cos, signed_sin)
        return super().rope(x, cos, signed_sin)


LAYER_OPS: Registry[type[TorchLayerOps]] = Registry("layer ops")
LAYER_OPS.register("torch")(TorchLayerOps)
LAYER_OPS.register("native")(NativeLayerOps)


def select_layer_ops(name: str, device: torch.device, dtype: torch.dtype) -> TorchLayerOps:
    """`auto`: native for 16-bit models on CPU when the C kernels build here, torch otherwise."""
    if name == "auto":
        wanted = device.type == "cpu" and dtype in NATIVE_DTYPES
        name = "native" if wanted and cpu_native.available() else "torch"
    return LAYER_OPS.get(name)()
