"""Model architectures by config.json `architectures` name, found by walking this package.

A model registers by being a module of pagedserve.engine.models that defines `ARCHITECTURES`, a mapping from the
HF architecture names it implements to its factory (usually the nn.Module class). Model modules never import this
module, so there is no import cycle, and no list here to forget to extend.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Any, Protocol

import torch
from torch import nn

from pagedserve.engine.errors import ModelLoadError
from pagedserve.kernels.registry import Registry
from pagedserve.quant.base import QuantConfig

_PACKAGE = "pagedserve.engine.models"


class ModelFactory(Protocol):
    def __call__(self, hf_config: dict[str, Any], quant: QuantConfig, dtype: torch.dtype) -> nn.Module: ...


def discover_architectures(package_name: str) -> Registry[ModelFactory]:
    """Every `ARCHITECTURES` entry of every module directly in `package_name` (a name claimed twice is an error)."""
    archs: Registry[ModelFactory] = Registry("model architecture")
    package = importlib.import_module(package_name)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package_name}.{info.name}")
        for name, factory in getattr(module, "ARCHITECTURES", {}).items():
            archs.register(name)(factory)
    return archs


@functools.cache
def model_archs() -> Registry[ModelFactory]:
    """The architectures of this package, imported once, on first use."""
    return discover_architectures(_PACKAGE)


def model_class_for(hf_config: dict[str, Any]) -> ModelFactory:
    archs = model_archs()
    names = hf_config.get("architectures") or []
    for name in names:
        if name in archs:
            return archs.get(name)
    raise ModelLoadError(
        f"architectures: {names or 'missing'} unsupported; supported: {', '.join(archs.names())} (a model registers "
        "by defining ARCHITECTURES in a module of engine/models/)"
    )
