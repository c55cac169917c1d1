"""Admission, health, drain on SIGTERM, reflection and metrics, each against a real server process."""

from __future__ import annotations

import os
import re
import signal
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from service_fixtures import (  # noqa: F401 - fixtures are used by name
    engine_idle,
    free_port,
    health,
    server_factory,
    shared_server,
    spawn_server,
    stub,
    wait_ready,
    wait_until,
)

from pagedserve.engine.loading.model_store import resolve_model
from pagedserve.v1 import generate_pb2 as pb

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def request(tokens: int, prompt: str = "Tell me about the sea.", **response: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, sampling=pb.SamplingOptions(temperature=0),
                              stopping=pb.StoppingOptions(max_new_tokens=tokens, ignore_eos=True),
                              response=pb.ResponseOptions(**response))


def test_full_admission_queue_is_resource_exhausted(server_factory):  # noqa: F811
    server = server_factory("--max-num-seqs", "1", "--max-queued-requests", "1")
    # The start names what each port speaks (a vLLM user's --port is HTTP there, gRPC here).
    assert re.search(rf"gRPC on \S+:{server.port} \(plaintext\), metrics port \d+, OpenAI HTTP off \(--http-port PORT "
                     r"serves it\)", server.log())
    with grpc.insecure_channel(server.target) as channel:
        running = stub(channel).Generate(request(400), timeout=300)
        next(f for f in running if f.WhichOneof("frame") == "delta")  # holds the only batch slot
        queued = stub(channel).Generate(request(400, heartbeat_ms=50), timeout=300)
        # Heartbeats flow while the request waits; they report the engine's waiting count once it sees it.
        frames = iter(queued)
        assert next(frames).WhichOneof("frame") == "heartbeat"
        next(f for f in frames if f.heartbeat.num_waiting >= 1)
        with pytest.raises(grpc.RpcError) as info:
            list(stub(channel).Generate(request(4), timeout=60))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue" in info.value.details()
        running.cancel()
        queued.cancel()
        wait_until(lambda: engine_idle(channel), 60, "the cancelled requests to leave the engine")
        # Once the queue drains, requests are admitted again.
        frames = list(stub(channel).Generate(request(2), timeout=120))
        assert frames[-1].final.usage.completion_tokens == 2


# Loaded into the server process through PYTHONPATH: an audit hook that holds the first open of the model's weights
# file until the test creates the release file, so the model load is observably in progress for as long as the
# test needs, however fast the host (Python's audit events, no hook in pagedserve).
_HOLD_OPEN = """
import os, sys, time
_held, _release = os.environ["PAGEDSERVE_TEST_HOLD_OPEN"], os.environ["PAGEDSERVE_TEST_RELEASE"]
def _hold(event, args):
    if event == "open" and args and str(args[0]) == _held:
        while not os.path.exists(_release):
            time.sleep(0.05)
sys.addaudithook(_hold)
"""


def test_health_serving_only_once_loaded_then_sigterm_drains_in_flight_streams(tmp_path, monkeypatch):
    port = free_port()
    hook, release = tmp_path / "hold-load", tmp_path / "release"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_HOLD_OPEN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("PAGEDSERVE_TEST_HOLD_OPEN", str(resolve_model(None).weights))
    monkeypatch.setenv("PAGEDSERVE_TEST_RELEASE", str(release))
    proc, ready, log = spawn_server(tmp_path / "drain", "--shutdown-grace", "120", port=port)
    seen: list[int] = []
    with grpc.insecure_channel(f"localhost:{port}") as channel:
        def answers() -> bool:
            try:
                seen.append(health(channel))
            except grpc.RpcError:  # not listening yet
                assert proc.poll() is None, log.read_text()[-3000:]
                return False
            return True

        try:
            wait_until(answers, 600, "the port to answer health")
            assert seen == [NOT_SERVING], "the port answers NOT_SERVING while the model loads"
            assert not ready.exists()
        finally:
            release.touch()
        wait_until(lambda: health(channel) == SERVING, 600, "health SERVING once the load can finish")
        assert health(channel, "pagedserve.v1.GenerationService") == SERVING
        wait_ready(proc, ready, log)

        streams = [stub(channel).Generate(request(48, prompt=p), timeout=300) for p in ("One", "Two")]
        firsts = [next(f for f in s if f.WhichOneof("frame") == "delta") for s in streams]
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: health(channel) == NOT_SERVING, 60, "health NOT_SERVING after SIGTERM")
        with pytest.raises(grpc.RpcError) as info:
            list(stub(channel).Generate(request(2), timeout=60))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        for first, stream in zip(firsts, streams):
            rest = list(stream)
            tokens = len(first.delta.token_ids) + sum(len(f.delta.token_ids) for f in rest)
            assert rest[-1].final.finish_reason == pb.FINISH_REASON_MAX_TOKENS
            assert tokens == 48, "the in-flight stream ran to completion"
    assert proc.wait(120) == 0, log.read_text()[-3000:]


def test_reflection_lists_and_describes_the_service_v1alpha_and_v1(shared_server):  # noqa: F811
    assert re.search(rf"gRPC on \S+:{shared_server.port} \(plaintext\), metrics port \d+, OpenAI HTTP on port "
                     rf"{shared_server.http_port};", shared_server.log())
    with grpc.insecure_channel(shared_server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        assert "pagedserve.v1.GenerationService" in services
        assert "grpc.health.v1.Health" in services
        file = db.FindFileContainingSymbol("pagedserve.v1.GenerationService")
        assert {m.name for m in file.service[0].method} == {"Generate", "Tokenize", "ModelInfo", "Embed", "Rerank"}
        # v1 shares v1alpha's wire format (only the package was renamed), so v1alpha messages can speak to it.
        v1 = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                   request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                   response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        [response] = list(v1(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30))
        assert "pagedserve.v1.GenerationService" in {s.name for s in response.list_services_response.service}


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=30).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def metric(samples: dict[str, float], prefix: str, *labels: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(prefix) and all(lab in k for lab in labels))


def test_prometheus_metrics_use_vllm_names_and_count_grpc_codes(shared_server):  # noqa: F811
    before = scrape(shared_server.metrics_port)
    with grpc.insecure_channel(shared_server.target) as channel:
        list(stub(channel).Generate(request(5), timeout=120))
        with pytest.raises(grpc.RpcError):
            list(stub(channel).Generate(pb.GenerateRequest(text=""), timeout=60))
    # The server counts an RPC when its handler returns, which can be just after the client saw the status.
    codes = ('grpc_code="OK"', 'grpc_code="INVALID_ARGUMENT"')

    def both_counted() -> bool:
        now = scrape(shared_server.metrics_port)
        return all(metric(now, "grpc_server_handled_total", c, 'grpc_method="Generate"')
                   > metric(before, "grpc_server_handled_total", c, 'grpc_method="Generate"') for c in codes)

    wait_until(both_counted, 10, "the server to count both RPCs")
    after = scrape(shared_server.metrics_port)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket"):
        assert any(k.startswith(name) for k in after), name

    def delta(prefix: str, *labels: str) -> float:
        return metric(after, prefix, *labels) - metric(before, prefix, *labels)

    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 4  # 5 tokens, 4 gaps
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:prefix_cache_queries_total") > 0
    assert delta("grpc_server_handled_total", 'grpc_code="OK"', 'grpc_method="Generate"') == 1
    assert delta("grpc_server_handled_total", 'grpc_code="INVALID_ARGUMENT"', 'grpc_method="Generate"') == 1
    assert 0 <= after['vllm:kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct"}'] <= 1
