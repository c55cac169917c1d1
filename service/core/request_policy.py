"""Server-wide request defaults and limits that vLLM sets by flag: `--generation-config` (the model's sampling
defaults, from its generation_config.json, for parameters a request leaves out) with `--override-generation-config`
over it, `--max-logprobs`, `--enable-force-include-usage` (every OpenAI stream carries its usage, as if it asked),
`--default-chat-template-kwargs` (template variables under each chat request's own) and `--response-role`.

`auto` (vLLM's default) reads generation_config.json beside the model's weights, `vllm` ignores it, a folder reads
that folder's. Only the sampling fields vLLM takes from it are used: temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as the default max_tokens; the override takes the same keys, over the file's
(or alone, with `vllm`), as vLLM merges them.
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
    # vLLM's --default-chat-template-kwargs: template variables a chat request's chat_template_kwargs go over
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    response_role: str = "assistant"  # vLLM's --response-role: a chat answer's role, when it adds a new turn
    # vLLM's --return-tokens-as-token-ids: logprobs name tokens "token_id:42" unless a request says otherwise
    return_tokens_as_token_ids: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.chat_template_kwargs, dict):
            raise ConfigError("default_chat_template_kwargs", f"must be a JSON object, got {self.chat_template_kwargs!r}")
        if not isinstance(self.response_role, str) or not self.response_role.strip():
            raise ConfigError("response_role", f"must be a non-empty role name, got {self.response_role!r}")
        if not isinstance(self.max_logprobs, int) or not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ConfigError("max_logprobs", f"must be in [0, {MAX_LOGPROBS}] (the engine returns at most "
                              f"{MAX_LOGPROBS} alternatives per token), got {self.max_logprobs!r}")


    def with_template_defaults(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat body whose chat_template_kwargs go over the server's defaults (a malformed one is left for the
        messages' reader to refuse by name)."""
        given = body.get("chat_template_kwargs", {})
        if not self.chat_template_kwargs or not isinstance(given, dict):
            return body
        return {**body, "chat_template_kwargs": {**self.chat_template_kwargs, **given}}


def generation_defaults(mode: str, model_folder: Path | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """--generation-config: auto (the model's folder, None for a GGUF file or an embedded model), vllm or a
    folder -> the sampling defaults requests start from; --override-generation-config's keys over them."""
    defaults = _file_defaults(mode, model_folder)
    if overrides:
        defaults = {**defaults, **_sampling_fields(overrides, "override_generation_config", strict=True)}
        log.info("sampling defaults with --override-generation-config: %s", defaults)
    return defaults


def _file_defaults(mode: str, model_folder: Path | None) -> dict[str, Any]:
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
    defaults = _sampling_fields(config, "generation_config", strict=False)
    if defaults:
        log.info("sampling defaults from %s (requests that leave them out get them; --generation-config vllm "
                 "turns this off): %s", path, defaults)
    return defaults


def _sampling_fields(config: dict[str, Any], source: str, strict: bool) -> dict[str, Any]:
    """The sampling keys of a generation config, max_new_tokens as max_tokens; `strict`: other keys are refused
    (an override names only what it means to set; a model's file holds much else)."""
    if not isinstance(config, dict):
        raise ConfigError(source, f"must be a JSON object, got {config!r}")
    known = (*_SAMPLING_KEYS, "max_new_tokens")
    if strict:
        for key in config:
            if key not in known:
                raise ConfigError(f"{source}.{key}", f"not a sampling default; supported: {', '.join(known)}")
    fields = {key: config[key] for key in _SAMPLING_KEYS if config.get(key) is not None}
    if config.get("max_new_tokens") is not None:
        fields["max_tokens"] = config["max_new_tokens"]
    return fields
