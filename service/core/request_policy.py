"""Server-wide request defaults and limits that vLLM sets by flag: `--generation-config` (the model's sampling
defaults, from its generation_config.json, for parameters a request leaves out), `--max-logprobs` and
`--enable-force-include-usage` (every OpenAI stream ends with its usage, as if it asked for it).

`auto` (vLLM's default) reads generation_config.json beside the model's weights, `vllm` ignores it, a folder reads
that folder's. Only the sampling fields vLLM takes from it are used: temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as the default max_tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.engine.errors import ConfigError
from pagedserve.engine.sampling_params import MAX_LOGPROBS

log = logging.getLogger(__name__)

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FILE_NAME = "generation_config.json"


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    sampling_defaults: dict[str, Any] = field(default_factory=dict, hash=False)  # OpenAI parameter -> value
    max_logprobs: int = MAX_LOGPROBS
    force_include_usage: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_logprobs, int) or not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ConfigError("max_logprobs", f"must be in [0, {MAX_LOGPROBS}] (the engine returns at most "
                              f"{MAX_LOGPROBS} alternatives per token), got {self.max_logprobs!r}")


def generation_defaults(mode: str, model_folder: Path | None) -> dict[str, Any]:
    """--generation-config: auto (the model's folder, None for a GGUF file or an embedded model), vllm or a
    folder -> the sampling defaults requests start from."""
    if mode == "vllm":
        return {}
    if mode == "auto":
        folder = model_folder
        if folder is None or not (folder / FILE_NAME).is_file():
            return {}  # GGUF files and embedded models carry no sampling defaults
    else:
        folder = Path(mode)
        if not (folder / FILE_NAME).is_file():
            raise ConfigError("generation_config", f"{folder / FILE_NAME} does not exist (auto, vllm or a folder "
                              "holding generation_config.json)")
    return _read(folder / FILE_NAME)


def _read(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError("generation_config", f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError("generation_config", f"{path} is not a JSON object")
    defaults = {key: config[key] for key in _SAMPLING_KEYS if config.get(key) is not None}
    if config.get("max_new_tokens") is not None:
        defaults["max_tokens"] = config["max_new_tokens"]
    if defaults:
        log.info("sampling defaults from %s (requests that leave them out get them; --generation-config vllm "
                 "turns this off): %s", path, defaults)
    return defaults
