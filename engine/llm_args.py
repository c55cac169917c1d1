"""vLLM's `LLM(...)` keyword arguments onto EngineConfig's fields, so an offline script written for vLLM runs
unchanged where each argument means what this engine does, and stops naming the argument where it does not:

- EngineConfig's own fields pass as they are (`max_model_len=`, `enforce_eager=`, `revision=`, ...);
- vLLM's spellings and JSON settings: `kv_cache_memory_bytes=` (kv_cache_memory), `speculative_config={...}`,
  `compilation_config=` (an optimization level or {...}), `structured_outputs_config={...}` (engine/json_configs.py
  reads both), `enable_lora=True` with `max_loras=`, `max_lora_rank=`, `max_cpu_loras=` (lora);
- accepted and unused: parallel sizes of 1, `trust_remote_code` (no checkpoint code runs), `swap_space` (preemption
  recomputes, as V1), `code_revision` and `hf_token` (nothing is downloaded), `disable_log_stats` (the offline
  engine logs no stats), `enable_chunked_prefill=True` (always: False is refused);
- anything else is refused naming it, with the names accepted.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError
from pagedserve.engine.json_configs import check_agrees, compilation_fields, structured_outputs_fields
from pagedserve.engine.lora.config import LoraConfig
from pagedserve.engine.spec_decode.config import SpeculativeConfig

ONE_DEVICE = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
UNUSED = ("trust_remote_code", "swap_space", "code_revision", "hf_token", "disable_log_stats")
_LORA = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
_TRANSLATED = ("kv_cache_memory_bytes", "speculative_config", "compilation_config", "structured_outputs_config",
               "enable_chunked_prefill", *_LORA)


def engine_fields(arguments: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig's keyword arguments for vLLM's LLM(...) ones (the model apart)."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    accepted = fields | set(ONE_DEVICE + UNUSED + _TRANSLATED)
    for name in arguments:
        if name not in accepted:
            raise ConfigError(name, f"is not an argument of LLM(...) here; accepted: {', '.join(sorted(accepted))}")
    for name in ONE_DEVICE:
        if arguments.get(name, 1) != 1:
            raise ConfigError(name, f"{arguments[name]!r}: one device per engine here; run more replicas instead")
    if arguments.get("enable_chunked_prefill", True) is not True:
        raise ConfigError("enable_chunked_prefill", "prefills are always chunked by max_num_batched_tokens here")
    given = {k: v for k, v in arguments.items() if k in fields}
    _kv_cache_bytes(arguments, given)
    if "speculative_config" in arguments:
        _set(given, "speculative", _speculative(arguments["speculative_config"]), "speculative_config")
    if arguments.get("compilation_config") is not None:
        given.update(compilation_fields(arguments["compilation_config"], given))
    if arguments.get("structured_outputs_config") is not None:
        given.update(structured_outputs_fields(arguments["structured_outputs_config"], given))
    lora = _lora(arguments)
    if lora is not None:
        _set(given, "lora", lora, "enable_lora")
    return given


def _set(given: dict[str, Any], field: str, value: Any, source: str) -> None:
    if given.get(field) is not None:
        raise ConfigError(source, f"sets {field}, which the {field}= argument sets too")
    given[field] = value


def _kv_cache_bytes(arguments: dict[str, Any], given: dict[str, Any]) -> None:
    if arguments.get("kv_cache_memory_bytes") is None:
        return
    check_agrees("kv_cache_memory_bytes", "kv_cache_memory", arguments["kv_cache_memory_bytes"], given)
    given["kv_cache_memory"] = arguments["kv_cache_memory_bytes"]


def _speculative(config: Any) -> SpeculativeConfig | None:
    if config is None or isinstance(config, SpeculativeConfig):
        return config
    if not isinstance(config, dict):
        raise ConfigError("speculative_config", f"must be a dict of vLLM's keys, got {config!r}")
    return SpeculativeConfig.from_json(json.dumps(config))


def _lora(arguments: dict[str, Any]) -> LoraConfig | None:
    """vLLM's enable_lora=True and its limits; the limits without it are refused rather than ignored."""
    limits = {k: arguments[k] for k in _LORA[1:] if arguments.get(k) is not None}
    if arguments.get("enable_lora") is not True:
        if limits:
            raise ConfigError(next(iter(limits)), "applies to LoRA adapters: pass enable_lora=True too")
        return None
    return LoraConfig(**limits)
