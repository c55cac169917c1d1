"""W3C traceparent parsing (service/core/trace_context.py), the rules of the Trace Context recommendation: what
is a parent, and what a server must ignore (then the request starts a new trace; it never fails)."""

from __future__ import annotations

import pytest

from pagedserve.service.core.trace_context import parse_traceparent, trace_context

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{SPAN}-01"


def test_a_valid_parent_and_its_round_trip():
    ctx = parse_traceparent(VALID, "congo=t61rcWkgMzE")
    assert (ctx.trace_id, ctx.parent_id, ctx.flags, ctx.sampled) == (TRACE, SPAN, 1, True)
    assert ctx.traceparent == VALID
    assert ctx.headers() == {"traceparent": VALID, "tracestate": "congo=t61rcWkgMzE"}
    assert not parse_traceparent(f"00-{TRACE}-{SPAN}-00").sampled


def test_a_later_version_may_carry_more_fields():
    assert parse_traceparent(f"01-{TRACE}-{SPAN}-01-what-the-future-adds").trace_id == TRACE


@pytest.mark.parametrize("value", [
    "", "garbage", f"ff-{TRACE}-{SPAN}-01", f"00-{TRACE}-{SPAN}-01-extra", f"00-{'0' * 32}-{SPAN}-01",
    f"00-{TRACE}-{'0' * 16}-01", f"00-{TRACE.upper()}-{SPAN}-01", f"00-{TRACE[:-1]}-{SPAN}-01",
    f"00-{TRACE}-{SPAN}-1", f"0-{TRACE}-{SPAN}-01", f"00_{TRACE}_{SPAN}_01",
])
def test_what_is_ignored(value):
    assert parse_traceparent(value) is None


def test_from_grpc_metadata_and_http_headers():
    metadata = (("x-request-id", "r1"), ("traceparent", VALID), ("tracestate", "a=1"), ("tracestate", "b=2"))
    assert trace_context(metadata).tracestate == "a=1,b=2"  # several list headers join, as HTTP says
    headers = [(b"host", b"x"), (b"traceparent", VALID.encode()), (b"tracestate", b"a=1")]
    ctx = trace_context(headers)
    assert (ctx.trace_id, ctx.tracestate) == (TRACE, "a=1")
    assert trace_context([(b"tracestate", b"a=1")]) is None  # a state without a parent is no context
    assert trace_context((("traceparent", VALID), ("traceparent", f"00-{TRACE}-{'1' * 16}-01"))) is None
    assert parse_traceparent(VALID, "x" * 1000).tracestate is None  # an oversized state is dropped, not the parent
