"""W3C trace context on each call: an explicit `traceparent` (and `tracestate`), or else the caller's current
OpenTelemetry context when `opentelemetry-api` is installed (the client itself needs no OpenTelemetry). The server
makes its span for the request a child of it."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

Metadata = tuple[tuple[str, str], ...]
_KEYS = ("traceparent", "tracestate")


def with_trace(metadata: Sequence[tuple[str, str]], traceparent: str | None, tracestate: str | None) -> Metadata:
    """`metadata` plus the trace headers; a traceparent the caller put in `metadata` itself is kept as it is."""
    metadata = tuple(metadata)
    if any(key == "traceparent" for key, _ in metadata):
        return metadata
    if traceparent is not None:
        return metadata + (("traceparent", traceparent),) + ((("tracestate", tracestate),) if tracestate else ())
    return metadata + current_context()


def current_context() -> Metadata:
    """The active OpenTelemetry span's context as headers; empty without opentelemetry-api or an active span."""
    inject = _injector()
    if inject is None:
        return ()
    carrier: dict[str, str] = {}
    inject(carrier)
    return tuple((key, carrier[key]) for key in _KEYS if key in carrier)


@cache
def _injector():  # noqa: ANN202 - opentelemetry.propagate.inject, or None
    try:
        from opentelemetry.propagate import inject
    except ImportError:
        return None
    return inject
