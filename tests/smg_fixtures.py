"""The two real pagedserve replicas behind the real SMG binary (tests/mesh_fixtures.py) that every test of
tests/test_smg_router.py shares, and the calls that file makes to them: the offline engine's greedy tokens to compare
with, SMG's streamed chat, a Generate straight to the VllmEngine service, each replica's counters. Only that file
imports them, so the module-scoped pair starts once; these helpers are its own, hence their private names."""

from __future__ import annotations

import http.client
import json

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc

from mesh_fixtures import http_json, start_smg
from service_fixtures import metric_value, off_main_thread, start_server

from pagedserve.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    servers = [start_server(tmp_path_factory.mktemp(f"replica{i}")) for i in range(2)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def smg(replicas, default_model, tmp_path_factory):
    router = start_smg(tmp_path_factory.mktemp("smg"), replicas, default_model.tokenizer_dir)
    yield router
    router.stop()


@pytest.fixture(scope="module")
def engine_stub(replicas):
    with grpc.insecure_channel(replicas[0].target) as channel:
        yield vgrpc.VllmEngineStub(channel)


def _post(url: str, body: dict) -> dict:
    return http_json(url, body)


def _offline(llm, prompt_ids: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return list(off_main_thread(llm.generate, prompt_ids, params)[0].outputs[0].token_ids)


def _sse(base: str, body: dict) -> list[dict]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"content-type": "application/json"})
    events = []
    for line in conn.getresponse().read().decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line.removeprefix("data: ")))
    conn.close()
    return events


def _generate(stub, ids: list[int], stream: bool = False, **sampling) -> list[vpb.GenerateResponse]:
    request = vpb.GenerateRequest(request_id="t", tokenized=vpb.TokenizedInput(input_ids=ids), stream=stream,
                                  sampling_params=vpb.SamplingParams(**sampling))
    return list(stub.Generate(request, timeout=120))


def _idle(server) -> bool:
    return (metric_value(server, "vllm:num_requests_running") == 0
            and metric_value(server, "pagedserve:kv_cache_blocks_active") == 0)


def _abort_calls(server) -> float:
    import urllib.request as r

    body = r.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith("grpc_server_handled_total{") and 'grpc_method="Abort"' in line
               and "vllm.grpc.engine.VllmEngine" in line)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}}


def _constrained(replicas) -> float:
    return sum(metric_value(r, "pagedserve:structured_output_requests_total") for r in replicas)
