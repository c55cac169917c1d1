"""Traces, request logs and metrics as an operator sees them, from real processes on loopback.

One replica runs with tracing to a real OTLP receiver (tests/otlp_receiver.py: the official TraceService on a
grpc server), JSON request logs and a 1 s stats line. Requests come by each front end, through Envoy and through
SMG (real binaries), each started with a W3C traceparent, and must arrive as one trace with the replica's span
under the caller's. Every metric family docs/observability.md lists is scraped from both ports and checked against
one request's own counts and timings.
"""

from __future__ import annotations

import re
import secrets
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from mesh_fixtures import SMG_MODEL, http_json, start_envoy, start_smg
from observability_fixtures import (SECRET_PROMPT, check_span, json_lines, new_traceparent, request_lines, span_for,
                                    v1_generate, v1_request)
from otlp_receiver import TraceReceiver, start_receiver
from service_fixtures import ServerProcess, start_server, wait_until
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc
from test_clients_go_java import Driver, built_clients  # noqa: F401 - built_clients is a fixture used by name
from test_clients_go_java import _missing as go_java_missing

from pagedserve.client import Client, GenerateOptions, build_request

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def receiver() -> Iterator[TraceReceiver]:
    r = start_receiver()
    yield r
    r.server.stop(None)


@pytest.fixture(scope="module")
def replica(receiver, tmp_path_factory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("traced"), "--otlp-traces-endpoint", receiver.endpoint,
                          "--enable-log-requests", "--stats-interval", "1", "--http-port", "0")
    yield server
    server.stop()


# --- each front end ----------------------------------------------------------------------------------------------


def test_v1_span_is_the_child_of_the_callers_traceparent(replica, receiver):
    traceparent, trace_id, parent = new_traceparent()
    frames = v1_generate(replica.target, v1_request("v1-traced"),
                         (("traceparent", traceparent), ("tracestate", "vendor=abc")))
    span = span_for(receiver, "v1-traced")
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent)
    check_span(span, "v1", frames[-1].final.usage.prompt_tokens, 6)


def test_openai_span_from_http_headers(replica, receiver):
    traceparent, trace_id, parent = new_traceparent()
    reply = http_json(f"{replica.http_url}/v1/completions", {
        "model": SMG_MODEL, "prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        {"traceparent": traceparent, "x-request-id": "openai-traced"})
    span = span_for(receiver, "openai-traced")
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent)
    check_span(span, "openai", reply["usage"]["prompt_tokens"], 5)


def test_router_protocol_span_from_grpc_metadata(replica, receiver):
    traceparent, trace_id, parent = new_traceparent()
    request = vpb.GenerateRequest(request_id="vllm-traced", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3, 4]),
                                  sampling_params=vpb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with grpc.insecure_channel(replica.target) as channel:
        replies = list(vgrpc.VllmEngineStub(channel).Generate(request, metadata=(("traceparent", traceparent),),
                                                             timeout=300))
    assert replies[-1].complete.completion_tokens == 4
    span = span_for(receiver, "vllm-traced")
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent)
    check_span(span, "vllm", 4, 4)


@pytest.mark.parametrize("metadata", [(), (("traceparent", "00-not-a-trace-01"),),
                                      (("traceparent", f"00-{'0' * 32}-{'1' * 16}-01"),)],
                         ids=["none", "malformed", "zero-trace-id"])
def test_without_a_valid_traceparent_the_span_starts_a_trace(replica, receiver, metadata):
    request_id = f"root-{len(metadata)}-{secrets.token_hex(3)}"
    v1_generate(replica.target, v1_request(request_id, tokens=2), metadata)
    span = span_for(receiver, request_id)
    assert span.parent_span_id == "" and re.fullmatch("[0-9a-f]{32}", span.trace_id)
    wait_until(lambda: "request_finished" in request_lines(replica, request_id), 30, "the finish line")
    assert request_lines(replica, request_id)["request_finished"]["trace_id"] == span.trace_id


# --- through the mesh --------------------------------------------------------------------------------------------


def test_through_envoy_one_trace(replica, receiver, tmp_path):
    envoy = start_envoy(tmp_path / "envoy", [replica])
    try:
        traceparent, trace_id, parent = new_traceparent()
        v1_generate(envoy.target, v1_request("envoy-traced", tokens=3), (("traceparent", traceparent),))
    finally:
        envoy.stop()
    span = span_for(receiver, "envoy-traced")
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent)


def test_through_smg_one_trace_down_to_the_replica(replica, receiver, default_model, tmp_path):
    """SMG (with its own tracing on, to the same receiver) adds its spans between the caller and the replica."""
    smg = start_smg(tmp_path / "smg", [replica], default_model.tokenizer_dir, "--enable-trace",
                    "--otlp-traces-endpoint", receiver.endpoint, policy="round_robin")
    try:
        traceparent, trace_id, parent = new_traceparent()
        reply = http_json(f"{smg.base}/v1/chat/completions", {
            "model": SMG_MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}, {"traceparent": traceparent})
    finally:
        smg.stop()
    ours = receiver.wait_for(lambda s: s.trace_id == trace_id and s.service == "pagedserve")
    assert ours.attributes["pagedserve.front_end"] == "vllm"
    assert ours.attributes["gen_ai.usage.completion_tokens"] == reply["usage"]["completion_tokens"] == 4
    # Walk up from the replica's span: every hop is in the same trace and the chain ends at the caller's span.
    spans = {s.span_id: s for s in receiver.in_trace(trace_id)}
    hop, chain = ours, []
    while hop.parent_span_id in spans:
        hop = spans[hop.parent_span_id]
        chain.append(hop.service)
    assert hop.parent_span_id == parent, f"chain {chain} does not end at the caller's span"
    assert chain and set(chain) == {"smg"}


# --- logs --------------------------------------------------------------------------------------------------------


def test_request_lines_carry_the_ids_and_never_the_prompt(replica, receiver):
    traceparent, trace_id, _ = new_traceparent()
    v1_generate(replica.target, v1_request("logged", SECRET_PROMPT, 3), (("traceparent", traceparent),))
    wait_until(lambda: "request_finished" in request_lines(replica, "logged"), 30, "the finish line")
    lines = request_lines(replica, "logged")
    admitted, finished = lines["request_admitted"], lines["request_finished"]
    for line in (admitted, finished):
        assert (line["trace_id"], line["front_end"], line["model"]) == (trace_id, "v1", SMG_MODEL)
        assert re.fullmatch("[0-9a-f]{16}", line["span_id"]) and line["adapter"] is None
        assert line["engine_request_id"].startswith("logged#")
    assert finished["output_tokens"] == 3 and finished["finish_reason"] == "length"
    assert finished["prompt_tokens"] == admitted["prompt_tokens"] > 5
    assert 0 <= finished["queue_s"] <= finished["ttft_s"] <= finished["e2e_s"]
    span = span_for(receiver, "logged")
    assert finished["span_id"] == span.span_id
    assert finished["ttft_s"] == pytest.approx(span.attributes["gen_ai.latency.time_to_first_token"], abs=1e-6)
    assert "zebra" not in replica.log()  # neither in a JSON line nor anywhere else
    assert not any("prompt" in r or "prompt_token_ids" in r or "outputs" in r for r in json_lines(replica))


def test_stats_line_reports_throughput_and_load(replica):
    v1_generate(replica.target, v1_request("for-stats", tokens=8))

    def busy_line() -> bool:
        return any(r["event"] == "stats" and r["generation_throughput"] > 0 for r in json_lines(replica))

    wait_until(busy_line, 30, "a stats line with generation throughput")
    line = next(r for r in json_lines(replica) if r["event"] == "stats" and r["generation_throughput"] > 0)
    assert set(line) >= {"ts", "interval_s", "prompt_throughput", "generation_throughput", "running", "waiting",
                         "kv_cache_usage", "prefix_cache_hit_rate"}
    assert 0 <= line["kv_cache_usage"] <= 1 and line["running"] >= 0 and line["waiting"] >= 0


# --- metrics -----------------------------------------------------------------------------------------------------


def documented_families() -> list[str]:
    text = (ROOT / "docs" / "observability.md").read_text()
    section = text[text.index("## Metrics"):]
    return re.findall(r"^\| `(vllm:[a-z0-9_]+)` \|", section, re.M)


def scrape(url: str) -> dict[str, float]:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def total(samples: dict[str, float], name: str, label: str = "") -> float:
    return sum(v for k, v in samples.items() if (k == name or k.startswith(name + "{")) and label in k)


def test_every_documented_family_on_both_ports_matches_one_request(replica):
    families = documented_families()
    assert len(families) >= 21
    ports = (f"http://127.0.0.1:{replica.metrics_port}/metrics", f"{replica.http_url}/metrics")
    before = scrape(ports[0])
    frames = v1_generate(replica.target, v1_request("metered", "Count: one, two, three,", 7))
    prompt = frames[-1].final.usage.prompt_tokens
    wait_until(lambda: total(scrape(ports[0]), "vllm:request_success_total") > total(before, "vllm:request_success_total"),
               30, "the request to be counted")
    wait_until(lambda: "request_finished" in request_lines(replica, "metered"), 30, "the finish line")
    line = request_lines(replica, "metered")["request_finished"]
    after, on_http = scrape(ports[0]), scrape(ports[1])

    def delta(name: str, label: str = "") -> float:
        return total(after, name, label) - total(before, name, label)

    for family in families:
        names = {family, family + "_total", family + "_count"}
        assert any(total(after, n) or any(k.startswith(n) for k in after) for n in names), family
        assert any(k.startswith(family) for k in on_http), f"{family} missing on the HTTP port"
    for key, value in after.items():  # one registry: the HTTP port shows the same counts (gauges may move)
        if key.startswith("vllm:") and ("_count" in key or "_sum" in key or "_total" in key):
            assert on_http.get(key) == value, key
    assert delta("vllm:request_success_total", 'finished_reason="length"') == 1
    assert (delta("vllm:prompt_tokens_total"), delta("vllm:generation_tokens_total")) == (prompt, 7)
    assert (delta("vllm:request_prompt_tokens_sum"), delta("vllm:request_generation_tokens_sum")) == (prompt, 7)
    assert delta("vllm:inter_token_latency_seconds_count") == 6
    # Alone on the engine, each step gave this request one token: 7 steps, the prompt counted in the first.
    assert (delta("vllm:iteration_tokens_total_count"), delta("vllm:iteration_tokens_total_sum")) == (7, prompt + 7)
    timings = {"vllm:request_queue_time_seconds": line["queue_s"], "vllm:time_to_first_token_seconds": line["ttft_s"],
               "vllm:request_prefill_time_seconds": line["prefill_s"],
               "vllm:request_decode_time_seconds": line["decode_s"], "vllm:e2e_request_latency_seconds": line["e2e_s"],
               "vllm:request_inference_time_seconds": line["prefill_s"] + line["decode_s"],
               "vllm:request_time_per_output_token_seconds": line["decode_s"] / 6}
    for family, seconds in timings.items():
        assert delta(family + "_count") == 1, family
        assert delta(family + "_sum") == pytest.approx(seconds, abs=2e-6), family
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert total(after, gauge) == 0
    assert 0 <= total(after, "vllm:kv_cache_usage_perc") <= 1


# --- client libraries --------------------------------------------------------------------------------------------


def test_python_client_sends_traceparent_per_call(replica, receiver):
    traceparent, trace_id, parent = new_traceparent()
    with Client(replica.target, timeout=120) as client:
        client.complete("Hello", max_new_tokens=2, temperature=0.0, request_id="py-traced", traceparent=traceparent,
                        tracestate="vendor=1")
    span = span_for(receiver, "py-traced")
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent)


def test_python_client_propagates_the_current_opentelemetry_span(replica, receiver):
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")  # a local provider: its spans go nowhere, their context does
    with tracer.start_as_current_span("caller") as caller, Client(replica.target, timeout=120) as client:
        client.complete("Hello", max_new_tokens=2, temperature=0.0, request_id="py-current")
        ctx = caller.get_span_context()
    span = span_for(receiver, "py-current")
    assert (span.trace_id, span.parent_span_id) == (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")


@pytest.mark.skipif(bool(go_java_missing), reason=f"Go/Java toolchains absent ({', '.join(go_java_missing)})")
@pytest.mark.parametrize("lang", ["go", "java"])
def test_go_and_java_clients_send_the_trace_context(lang, replica, receiver, built_clients, tmp_path):  # noqa: F811
    driver = Driver(lang, replica.target, tmp_path)
    try:
        traceparent, trace_id, parent = new_traceparent()
        request = json_format.MessageToDict(build_request("Hello", GenerateOptions(
            temperature=0.0, max_new_tokens=2, request_id=f"{lang}-traced")))
        got = driver.call("generate", request=request, traceparent=traceparent, tracestate="vendor=1")
        assert got["error"] is None
    finally:
        driver.close()
    span = span_for(receiver, f"{lang}-traced")
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent)
