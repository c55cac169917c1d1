"""vLLM's JSON-object settings onto the EngineConfig fields that do the same, in one place for both entries:
`pagedserve serve`'s flags (`--compilation-config`, `--structured-outputs-config`) and the keyword arguments of
`LLM(...)` (`compilation_config=`, `structured_outputs_config=`).

- compilation_config: `cudagraph_capture_sizes` (exactly those sizes; one size N is 1, 2, 4 and the multiples of 8
  up to N, a superset, as --cuda-graph-sizes N reads it), `max_cudagraph_capture_size` (1, 2, 4 and the multiples of
  8 up to it), `cudagraph_mode` ("NONE" is enforce_eager; every other mode captures this engine's graphs, which are
  vLLM's FULL_DECODE_ONLY: whole decode steps, other steps eager). `level` / `mode` (torch.compile's optimization
  level, also a bare integer) change nothing: the model is never compiled by torch here.
- structured_outputs_config: `backend` (llguidance is vLLM's "guidance"; "auto" picks it, the only one here),
  `reasoning_parser`, `enable_in_reasoning`; `disable_fallback` changes nothing (one backend).

Other keys are refused naming them (`compilation_config.<key>`); a key that disagrees with the field's own setting
too.
"""

from __future__ import annotations

from typing import Any

from pagedserve.engine.errors import ConfigError

COMPILATION = "compilation_config"
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
_COMPILATION_NO_OPS = ("level", "mode")  # torch.compile's optimization level: nothing here is compiled by torch
_COMPILATION_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size", "cudagraph_mode", *_COMPILATION_NO_OPS)

STRUCTURED = "structured_outputs_config"
_BACKENDS = {"auto": "llguidance", "guidance": "llguidance", "llguidance": "llguidance"}
_STRUCTURED_NO_OPS = ("disable_fallback",)  # only chooses among backends this engine does not have
_STRUCTURED_KEYS = ("backend", "reasoning_parser", "enable_in_reasoning", *_STRUCTURED_NO_OPS)


def check_agrees(source: str, field: str, value: Any, given: dict[str, Any]) -> None:
    """A JSON key (`source`) sets `field` to `value`: refused when the field's own setting says otherwise."""
    other = given.get(field)
    other = tuple(other) if isinstance(other, list) else other  # argparse's nargs lists; the fields hold tuples
    if other is not None and other != value:
        raise ConfigError(source, f"{value!r} disagrees with --{field.replace('_', '-')} {other!r}")


def entries(config: Any, name: str, keys: tuple[str, ...], no_ops: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    """The (key, value) pairs of a JSON object that set something, once every key is one of `keys` (`no_ops` among
    them are accepted and dropped). Errors name `name`, or `name.key`."""
    if not isinstance(config, dict):
        raise ConfigError(name, f"must be a JSON object, got {config!r}")
    for key in config:
        if key not in keys:
            raise ConfigError(f"{name}.{key}", f"unknown or unsupported key; supported: {', '.join(keys)}")
    return [(key, value) for key, value in config.items() if key not in no_ops]


def compilation_fields(config: dict | int, given: dict[str, Any]) -> dict[str, Any]:
    """The fields a compilation config sets; `given`: the fields set otherwise (None: not given)."""
    if isinstance(config, int) and not isinstance(config, bool):
        return {}  # -O3, compilation_config=3: an optimization level for torch.compile, which nothing here runs
    fields: dict[str, Any] = {}
    for key, value in entries(config, COMPILATION, _COMPILATION_KEYS, _COMPILATION_NO_OPS):
        field, value = _compilation_field(key, value)
        check_agrees(f"{COMPILATION}.{key}", field, value, {**given, **fields})
        fields[field] = value
    return fields


def structured_outputs_fields(config: dict, given: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, value in entries(config, STRUCTURED, _STRUCTURED_KEYS, _STRUCTURED_NO_OPS):
        field, value = _structured_field(key, value)
        check_agrees(f"{STRUCTURED}.{key}", field, value, given)
        fields[field] = value
    return fields


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _compilation_field(key: str, value: Any) -> tuple[str, Any]:
    if key == "cudagraph_mode":
        if value not in CUDAGRAPH_MODES:
            raise ConfigError(f"{COMPILATION}.cudagraph_mode", f"{value!r}; supported: {', '.join(CUDAGRAPH_MODES)}")
        return "enforce_eager", value == "NONE"
    if key == "max_cudagraph_capture_size":
        if not _positive(value):
            raise ConfigError(f"{COMPILATION}.{key}", f"must be a positive integer, got {value!r}")
        return "cuda_graph_sizes", (value,)
    if not isinstance(value, list) or not value or not all(_positive(s) for s in value):
        raise ConfigError(f"{COMPILATION}.{key}", f"must be a non-empty list of positive integers, got {value!r}")
    # Several sizes: exactly those. One size N reads as --cuda-graph-sizes N: vLLM's pattern up to N, a superset.
    return "cuda_graph_sizes", tuple(value)


def _structured_field(key: str, value: Any) -> tuple[str, Any]:
    if key == "backend":
        if value not in _BACKENDS:
            raise ConfigError(f"{STRUCTURED}.backend", f"{value!r} is not available; this server's grammar library "
                              "is llguidance (vLLM's \"guidance\"): auto, guidance")
        return "structured_output_backend", _BACKENDS[value]
    if key == "enable_in_reasoning":
        if not isinstance(value, bool):
            raise ConfigError(f"{STRUCTURED}.enable_in_reasoning", f"must be true or false, got {value!r}")
        return "constraints_in_reasoning", value
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{STRUCTURED}.reasoning_parser", f"must be a parser's name, got {value!r}")
    return "reasoning_parser", value
