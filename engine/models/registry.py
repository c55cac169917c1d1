"""Model architectures by config.json `architectures` name."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from pagedserve.engine.errors import ModelLoadError
from pagedserve.kernels.registry import Registry
from pagedserve.quant.base import QuantConfig


class ModelFactory(Protocol):
    def __call__(self, hf_config: dict[str, Any], quant: QuantConfig, dtype: torch.dtype) -> nn.Module: ...


MODEL_ARCHS: Registry[ModelFactory] = Registry("model architecture")


def model_class_for(hf_config: dict[str, Any]) -> ModelFactory:
    from pagedserve.engine.models import llama  # noqa: F401  (registers the Llama family)

    names = hf_config.get("architectures") or []
    for name in names:
        if name in MODEL_ARCHS:
            return MODEL_ARCHS.get(name)
    raise ModelLoadError(
        f"architectures: {names or 'missing'} unsupported; supported: {', '.join(MODEL_ARCHS.names())}"
    )
