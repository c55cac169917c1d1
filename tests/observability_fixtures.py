"""What the observability tests send and look for: a W3C traceparent like a real caller's, a pagedserve.v1 request
run to its length, the replica's span for a request id (found in tests/otlp_receiver.py's receiver) with what every
such span must hold, and a server's JSON request lines."""

from __future__ import annotations

import json
import secrets

import grpc
import pytest
from mesh_fixtures import SMG_MODEL
from otlp_receiver import SPAN_KIND_SERVER, ReceivedSpan, TraceReceiver
from service_fixtures import ServerProcess, stub

from pagedserve.v1 import generate_pb2 as pb

SECRET_PROMPT = "The lighthouse keeper's password is zebra-kumquat"
LATENCIES = ("gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e",
             "gen_ai.latency.time_in_model_prefill", "gen_ai.latency.time_in_model_decode",
             "gen_ai.latency.time_in_model_inference")


def new_traceparent() -> tuple[str, str, str]:
    """(traceparent, trace id, parent span id), random like a real caller's."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def json_lines(server: ServerProcess) -> list[dict]:
    out = []
    for line in server.log().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))  # every line that looks like JSON must be JSON
    return out


def request_lines(server: ServerProcess, request_id: str) -> dict[str, dict]:
    return {r["event"]: r for r in json_lines(server) if r.get("request_id") == request_id}


def span_for(receiver: TraceReceiver, request_id: str) -> ReceivedSpan:
    return receiver.wait_for(lambda s: s.service == "pagedserve" and s.attributes.get("gen_ai.request.id") == request_id)


def check_span(span: ReceivedSpan, front_end: str, prompt_tokens: int, completion_tokens: int) -> None:
    a = span.attributes
    assert (span.name, span.kind) == ("llm_request", SPAN_KIND_SERVER)
    assert a["pagedserve.front_end"] == front_end and a["gen_ai.response.model"] == SMG_MODEL
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (prompt_tokens, completion_tokens)
    assert a["gen_ai.request.max_tokens"] == completion_tokens and a["gen_ai.request.n"] == 1
    assert all(a[k] >= 0 for k in LATENCIES)
    # vLLM's phases add up: queue + prefill = time to first token; prefill + decode = inference <= e2e.
    assert a["gen_ai.latency.time_in_queue"] + a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(
        a["gen_ai.latency.time_to_first_token"], abs=1e-6)
    assert a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"] == pytest.approx(
        a["gen_ai.latency.time_in_model_inference"], abs=1e-6)
    assert a["gen_ai.latency.time_in_model_inference"] <= a["gen_ai.latency.e2e"] + 1e-6
    assert span.start_ns <= span.events["first_scheduled"] <= span.events["first_token"] <= span.end_ns


def v1_request(request_id: str, prompt: str = "The capital of France is", tokens: int = 6) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, request_id=request_id, sampling=pb.SamplingOptions(temperature=0),
                              stopping=pb.StoppingOptions(max_new_tokens=tokens, ignore_eos=True))


def v1_generate(target: str, request: pb.GenerateRequest, metadata: tuple = ()) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(target) as channel:
        frames = list(stub(channel).Generate(request, metadata=metadata, timeout=300))
    assert frames[-1].final.finish_reason == pb.FINISH_REASON_MAX_TOKENS
    return frames
