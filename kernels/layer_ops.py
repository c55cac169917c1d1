"""The elementwise math of a decoder layer (RMSNorm, residual add, SiLU-and-mul, RoPE), behind one small interface.

`torch` (here) is transformers' op order, bit for bit (the fp32 engine's greedy output must equal transformers').
`native` (kernels/cpu/layer_ops.py) runs the same math fused in C for 16-bit dtypes on CPU, where torch's separate small
ops cost ~15% of a decode step. Names and selection: kernels/backends.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F

from pagedserve.kernels.requirements import Requirements


class LayerOps(ABC):
    """What a model layer calls for its elementwise math; one instance serves every layer of a model."""

    requirements: ClassVar[Requirements] = Requirements()  # checked against the engine config at startup

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., hidden] -> weight * x / rms(x), computed in fp32 and rounded to x's dtype before the weight."""

    @abstractmethod
    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual + delta, RMSNorm of that sum); may update `residual` in place."""

    @abstractmethod
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] ([gate | up]) -> silu(gate) * up [T, I]."""

    @abstractmethod
    def rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x [T, N, D] -> (x * cos) + (rotate_half(x) * sin); sin arrives sign-folded (see RopeAngles)."""


class TorchLayerOps(LayerOps):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm, so fp32 results are bit-identical.
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + delta
        return total, self.rms_norm(total, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        tokens, heads, dim = x.shape
        swapped = x.reshape(tokens, heads, 2, dim // 2).flip(2).view(tokens, heads, dim)  # [x2, x1]
        return x * cos + swapped * signed_sin
