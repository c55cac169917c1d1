"""Servers started with other observability settings than tests/test_observability.py's traced replica, each its
own: traces exported over OTLP/HTTP instead of gRPC, prompts and outputs in the request log only when asked (and
cut to --max-log-len), and a server without the otel extra, which refuses tracing by name yet serves.
"""

from __future__ import annotations

import pytest
from observability_fixtures import SECRET_PROMPT, new_traceparent, request_lines, span_for, v1_generate, v1_request
from otlp_receiver import TraceReceiver, start_http_receiver
from service_fixtures import spawn_server, start_server, wait_until

pytestmark = pytest.mark.timeout(900)


def test_otlp_over_http_protobuf(tmp_path):
    receiver = TraceReceiver()
    http = start_http_receiver(receiver)
    server = start_server(tmp_path / "http-otlp", "--otlp-traces-protocol", "http/protobuf",
                          "--otlp-traces-endpoint", f"127.0.0.1:{http.server_address[1]}", "--stats-interval", "0")
    try:
        traceparent, trace_id, parent = new_traceparent()
        v1_generate(server.target, v1_request("over-http", tokens=2), (("traceparent", traceparent),))
        span = span_for(receiver, "over-http")
    finally:
        server.stop()
        http.shutdown()
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent)


def test_log_prompts_and_outputs_only_when_asked(tmp_path):
    """--log-prompts and vLLM's --enable-log-outputs, each cut to --max-log-len tokens (and characters)."""
    server = start_server(tmp_path / "prompts", "--enable-log-requests", "--log-prompts", "--enable-log-outputs",
                          "--max-log-len", "4", "--stats-interval", "0")
    try:
        frames = {n: v1_generate(server.target, v1_request(f"with-prompt-{n}", SECRET_PROMPT, n)) for n in (2, 6)}
        wait_until(lambda: all("request_finished" in request_lines(server, f"with-prompt-{n}") for n in (2, 6)), 30,
                   "the finish lines")
        lines = {n: request_lines(server, f"with-prompt-{n}") for n in (2, 6)}
    finally:
        server.stop()
    admitted = lines[2]["request_admitted"]
    assert len(admitted["prompt_token_ids"]) == 4 and SECRET_PROMPT.startswith(admitted["prompt"])
    assert admitted["trace_id"] is None and admitted["span_id"] is None  # no traceparent, no tracing
    for n, cut in ((2, 2), (6, 4)):
        ids = [t for f in frames[n] if f.HasField("delta") for t in f.delta.token_ids]
        text = "".join(f.delta.text for f in frames[n] if f.HasField("delta"))
        [output] = lines[n]["request_finished"]["outputs"]
        assert output["index"] == 0 and output["token_ids"] == ids[:cut] and output["text"] == text[:4], output


# --- without OpenTelemetry ---------------------------------------------------------------------------------------


@pytest.fixture
def no_otel(tmp_path) -> dict[str, str]:
    """PYTHONPATH with an `opentelemetry` package that cannot be imported: as if the otel extra were absent."""
    shadow = tmp_path / "shadow" / "opentelemetry"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('opentelemetry is not installed (test shadow)')\n")
    return {"PYTHONPATH": str(shadow.parent)}


def test_without_the_otel_extra_tracing_is_refused_by_name(tmp_path, no_otel):
    proc, _, log_path = spawn_server(tmp_path / "refused", "--otlp-traces-endpoint", "127.0.0.1:4317", env=no_otel)
    assert proc.wait(120) == 2
    log = log_path.read_text()
    assert "otlp_traces_endpoint" in log and "pagedserve[otel]" in log, log[-2000:]


def test_without_the_otel_extra_the_server_serves_with_tracing_off(tmp_path, no_otel):
    server = start_server(tmp_path / "plain", "--enable-log-requests", env=no_otel)
    try:
        traceparent, trace_id, _ = new_traceparent()
        v1_generate(server.target, v1_request("no-otel", tokens=2), (("traceparent", traceparent),))
        wait_until(lambda: "request_finished" in request_lines(server, "no-otel"), 30, "the finish line")
        assert request_lines(server, "no-otel")["request_finished"]["trace_id"] == trace_id
    finally:
        server.stop()
