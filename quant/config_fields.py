"""Typed reads of `quantization_config` fields: every error names the field and what is accepted."""

from __future__ import annotations

from typing import Any, Sequence

from pagedserve.quant.base import QuantConfigError

_MISSING = object()


def get_int(qc: dict[str, Any], key: str, where: str, default: Any = _MISSING) -> int:
    value = qc.get(key, default)
    if value is None and default is not _MISSING:
        value = default
    if value is _MISSING:
        raise QuantConfigError(f"{where}.{key}", "missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise QuantConfigError(f"{where}.{key}", f"expected an integer, got {value!r}")
    return value


def get_bool(qc: dict[str, Any], key: str, where: str, default: bool) -> bool:
    value = qc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise QuantConfigError(f"{where}.{key}", f"expected true or false, got {value!r}")
    return value


def get_choice(qc: dict[str, Any], key: str, where: str, value: Any, choices: Sequence[str]) -> str:
    """`value` already resolved by the caller (it may come from an alias field); validated here."""
    if isinstance(value, str):
        value = value.lower()
    if value not in choices:
        raise QuantConfigError(f"{where}.{key}", f"{value!r} is not supported; supported: {list(choices)}")
    return value
