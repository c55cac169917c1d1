"""Plain FP32/FP16/BF16 weights."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.quant.base import QUANT_METHODS, LinearMethod, QuantConfig


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


@QUANT_METHODS.register("none")
class UnquantizedConfig(QuantConfig):
    name = "none"

    @classmethod
    def from_hf(cls, quantization_config: dict[str, Any]) -> "UnquantizedConfig":
        return cls()

    def linear_method(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod()
