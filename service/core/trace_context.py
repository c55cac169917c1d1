"""W3C Trace Context (`traceparent`, `tracestate`) read from a request's gRPC metadata or HTTP headers.

Parsed here without OpenTelemetry, so request logs carry the caller's trace id even when tracing is off, and a
server without the `otel` extra still reads it. A malformed `traceparent` is ignored, as the W3C recommendation
says (the request then starts a new trace); it never fails the request.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
# version 00 exactly, or a later version followed by fields this parser does not know (kept, per the spec).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_MAX_TRACESTATE = 512  # the spec lets a vendor list grow to 32 members; beyond that it may be dropped


@dataclass(frozen=True, slots=True)
class TraceContext:
    trace_id: str  # 32 lowercase hex digits
    parent_id: str  # the caller's span id, 16 hex digits
    flags: int  # bit 0: sampled
    tracestate: str | None = None

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags:02x}"

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)

    def headers(self) -> dict[str, str]:
        """As a carrier for a propagator (OpenTelemetry's TraceContextTextMapPropagator reads these keys)."""
        carrier = {TRACEPARENT: self.traceparent}
        if self.tracestate:
            carrier[TRACESTATE] = self.tracestate
        return carrier


def parse_traceparent(value: str, tracestate: str | None = None) -> TraceContext | None:
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, parent_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(parent_id) == {"0"}:
        return None
    if tracestate is not None and len(tracestate) > _MAX_TRACESTATE:
        tracestate = None
    return TraceContext(trace_id, parent_id, int(flags, 16), tracestate or None)


def trace_context(pairs: Iterable[tuple[str | bytes, str | bytes]]) -> TraceContext | None:
    """From gRPC invocation metadata (str keys and values) or ASGI headers (bytes): both are lowercase key/value
    pairs. Several `tracestate` headers join with commas (HTTP's rule for a list header)."""
    parent, states = None, []
    for key, value in pairs:
        if isinstance(key, bytes):
            key = key.decode("latin-1")
        if key != TRACEPARENT and key != TRACESTATE:
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if key == TRACEPARENT:
            if parent is not None:
                return None  # two parents: ambiguous, start a new trace
            parent = value
        else:
            states.append(value)
    if parent is None:
        return None
    return parse_traceparent(parent, ",".join(states) if states else None)
