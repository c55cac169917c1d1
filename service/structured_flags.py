"""`pagedserve serve --structured-outputs-config '<json>'`: vLLM's flag and keys, onto the engine fields that do the
same (`structured_output_backend`, `reasoning_parser`, `constraints_in_reasoning`), so a vLLM command line carries
over. The one grammar library here is llguidance, vLLM's "guidance" backend; keys this server cannot honour are
refused naming them (`structured_outputs_config.<key>`), and a key that disagrees with its own flag too."""

from __future__ import annotations

import argparse
from typing import Any

from pagedserve.engine.errors import ConfigError
from pagedserve.service.engine_flags import check_agrees, json_flag_entries

FLAG_FIELD = "structured_outputs_config"
# vLLM's backend names -> this server's (llguidance is vLLM's "guidance"; "auto" picks it, the only one here).
_BACKENDS = {"auto": "llguidance", "guidance": "llguidance", "llguidance": "llguidance"}
# vLLM's keys that only choose among backends this server does not have: accepted as they change nothing.
_NO_OPS = ("disable_fallback",)
_KEYS = ("backend", "reasoning_parser", "enable_in_reasoning", *_NO_OPS)


def add_structured_outputs_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--structured-outputs-config", metavar="JSON",
                        help='vLLM\'s structured-output settings: {"backend": "auto"|"guidance", "reasoning_parser": '
                             'NAME, "enable_in_reasoning": false} (the same as --structured-output-backend, '
                             "--reasoning-parser and --constraints-in-reasoning)")


def structured_outputs_fields(args: argparse.Namespace, given: dict[str, Any]) -> dict[str, Any]:
    """The engine fields the JSON sets; `given`: the fields the other flags set (None: not given)."""
    text = getattr(args, FLAG_FIELD, None)
    if text is None:
        return {}
    fields = {}
    for key, value in json_flag_entries(text, FLAG_FIELD, _KEYS, _NO_OPS):
        field, value = _field(key, value)
        check_agrees(f"{FLAG_FIELD}.{key}", field, value, given)
        fields[field] = value
    return fields


def _field(key: str, value: Any) -> tuple[str, Any]:
    if key == "backend":
        if value not in _BACKENDS:
            raise ConfigError(f"{FLAG_FIELD}.backend", f"{value!r} is not available; this server's grammar library "
                              "is llguidance (vLLM's \"guidance\"): auto, guidance")
        return "structured_output_backend", _BACKENDS[value]
    if key == "enable_in_reasoning":
        if not isinstance(value, bool):
            raise ConfigError(f"{FLAG_FIELD}.enable_in_reasoning", f"must be true or false, got {value!r}")
        return "constraints_in_reasoning", value
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{FLAG_FIELD}.reasoning_parser", f"must be a parser's name, got {value!r}")
    return "reasoning_parser", value
