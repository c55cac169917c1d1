"""Pick the quantization method for a checkpoint from its config (or an explicit override)."""

from __future__ import annotations

from typing import Any

from pagedserve.quant.base import QUANT_METHODS, QuantConfig, QuantConfigError
from pagedserve.quant import unquantized  # noqa: F401  (registers "none")


def quant_config_for(hf_config: dict[str, Any], override: str | None = None) -> QuantConfig:
    """`override` (from --quantization) must agree with the checkpoint when the checkpoint names a method."""
    qcfg = hf_config.get("quantization_config") or {}
    method = qcfg.get("quant_method")
    if override is not None and method is not None and override != method:
        raise QuantConfigError("quantization", f"--quantization {override!r} but the checkpoint says {method!r}")
    name = override or method or "none"
    try:
        cls = QUANT_METHODS.get(name)
    except LookupError as exc:
        raise QuantConfigError("quantization_config.quant_method", str(exc)) from None
    return cls.from_hf(qcfg)
