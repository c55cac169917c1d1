"""The one linear layer every model uses; its quantization method decides storage and math."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.quant.base import LinearMethod


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethod, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.method = method
        self.loaded_tensors: set[str] = set()
        # The weight is another module's tensor (a tied LM head over the embedding): a method repacking it keeps that
        # tensor rather than dropping it, since dropping frees nothing, and may read it in place.
        self.weight_shared = False
        method.create_weights(self, in_features, out_features, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, method={type(self.method).__name__}"
