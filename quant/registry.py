"""Quantization methods by name, and the method for a checkpoint from its config (or an explicit override)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from pagedserve.kernels.registry import Registry
from pagedserve.quant.awq import AWQConfig
from pagedserve.quant.base import QuantConfig, QuantConfigError
from pagedserve.quant.gguf import GgufConfig
from pagedserve.quant.gptq import GPTQConfig
from pagedserve.quant.unquantized import UnquantizedConfig

# The one place methods are registered (method modules import only base.py, never this module).
QUANT_METHODS: Registry[type[QuantConfig]] = Registry("quantization method")
for _method in (UnquantizedConfig, GPTQConfig, AWQConfig, GgufConfig):
    QUANT_METHODS.register(_method.name)(_method)

# Older checkpoints keep the settings beside config.json instead of inside it.
SIDE_FILES = ("quantize_config.json", "quant_config.json")
_AWQ_ONLY_KEYS = ("w_bit", "q_group_size", "zero_point", "version")


def quant_config_for(
    hf_config: dict[str, Any],
    override: str | None = None,
    model_dir: str | Path | None = None,
    kernel: str = "auto",
) -> QuantConfig:
    """`override` (from --quantization) must agree with the checkpoint when the checkpoint names a method.

    config.json's `quantization_config` wins; without it, quantize_config.json / quant_config.json in
    `model_dir` are read. `kernel` forces one quantized linear kernel ("auto": best available)."""
    qcfg, source = _find(hf_config, model_dir)
    method = qcfg.get("quant_method") or (_infer_method(qcfg, source) if qcfg else None)
    if isinstance(method, str):
        method = method.lower()
    if method == "compressed-tensors" and not qcfg.get("config_groups"):
        method = None  # only a kv_cache_scheme (FP8 KV scales, read by kernels/kv_scales.py): weights unquantized
    if override is not None and method is not None and override != method:
        raise QuantConfigError("quantization", f"--quantization {override!r} but the checkpoint says {method!r}")
    name = override or method or "none"
    try:
        cls = QUANT_METHODS.get(name)
    except LookupError as exc:
        raise QuantConfigError(f"{source}.quant_method", str(exc)) from None
    if name != "none" and not qcfg:
        raise QuantConfigError("quantization", f"{name!r} requested but the checkpoint has no quantization_config "
                               f"in config.json nor any of {list(SIDE_FILES)}")
    cfg = cls.from_hf(qcfg)
    if kernel != "auto":
        if not hasattr(cfg, "kernel"):
            raise QuantConfigError("kernel", f"method {name!r} has no quantized kernels to choose from")
        cfg = dataclasses.replace(cfg, kernel=kernel)
    return cfg


def _find(hf_config: dict[str, Any], model_dir: str | Path | None) -> tuple[dict[str, Any], str]:
    qcfg = hf_config.get("quantization_config")
    if qcfg:
        if not isinstance(qcfg, dict):
            raise QuantConfigError("quantization_config", f"expected an object, got {type(qcfg).__name__}")
        return qcfg, "quantization_config"
    if model_dir is not None:
        for name in SIDE_FILES:
            path = Path(model_dir) / name
            if path.is_file():
                try:
                    data = json.loads(path.read_text())
                except json.JSONDecodeError as exc:
                    raise QuantConfigError(name, f"not valid JSON: {exc}") from None
                if not isinstance(data, dict):
                    raise QuantConfigError(name, f"expected an object, got {type(data).__name__}")
                return data, name.removesuffix(".json")
    return {}, "quantization_config"


def _infer_method(qcfg: dict[str, Any], source: str) -> str:
    """Side files from AutoGPTQ < 0.7 / AutoAWQ carry no quant_method."""
    if source == "quant_config" or any(k in qcfg for k in _AWQ_ONLY_KEYS):
        return "awq"
    return "gptq"
