"""Pick the quantization method for a checkpoint from its config (or an explicit override)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedserve.quant.base import QUANT_METHODS, QuantConfig, QuantConfigError
from pagedserve.quant import unquantized  # noqa: F401  (registers "none")


def quant_config_for(hf_config: dict[str, Any], override: str | None = None, model_dir: Path | None = None) -> QuantConfig:
    """`override` (from --quantization) must agree with the checkpoint when the checkpoint names a method.

    quantize_config.json (older AutoGPTQ/AutoAWQ exports) is the fallback when config.json has no section.
    """
    qcfg = hf_config.get("quantization_config") or {}
    if not qcfg and model_dir is not None and (Path(model_dir) / "quantize_config.json").is_file():
        qcfg = json.loads((Path(model_dir) / "quantize_config.json").read_text())
    method = qcfg.get("quant_method")
    if override is not None and method is not None and override != method:
        raise QuantConfigError("quantization", f"--quantization {override!r} but the checkpoint says {method!r}")
    name = override or method or "none"
    try:
        cls = QUANT_METHODS.get(name)
    except LookupError as exc:
        raise QuantConfigError("quantization_config.quant_method", str(exc)) from None
    return cls.from_hf(qcfg)
