"""`pagedserve serve MODEL --api-key KEY` (vLLM's positional model and key): the OpenAI HTTP API and every gRPC
service need `Bearer KEY` (HTTP 401 / gRPC UNAUTHENTICATED otherwise, the request never reaching the engine);
health checks and metrics stay open; the right key serves as usual, through the official clients. The same server
keeps a CORS rule (vLLM's --allowed-origins, --allowed-headers, --allow-credentials): a browser's preflight needs no
key, another origin is refused, and a 401 still carries the CORS headers so the page can read it; and vLLM's
--root-path: routes answer under the prefix and without it, health open under both."""

from __future__ import annotations

import urllib.request

import grpc
import openai
import pytest
import requests
from service_fixtures import health, model_info, start_server, stub

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import model_info_pb2

KEY = "s3cret-key-for-tests"
MODEL = "SmolLM2-135M-Instruct"
APP = "https://app.example"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("api-key"), MODEL, "--api-key", KEY, "--http-port", "0",
                          "--allowed-origins", f'["{APP}"]', "--allowed-headers", "authorization", "content-type",
                          "--allow-credentials", "--root-path", "/llm")
    yield server
    server.stop()


def _metadata(value: str | None) -> list[tuple[str, str]]:
    return [] if value is None else [("authorization", value)]


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", KEY, "Bearer "])
def test_http_refuses_without_the_key(keyed, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path, body in [("POST", "/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "user", "content": "Hi"}], "max_tokens": 2}), ("GET", "/v1/models", None),
            ("POST", "/tokenize", {"prompt": "Hi"}), ("GET", "/version", None)]:
        reply = requests.request(method, f"{keyed.http_url}{path}", json=body, headers=headers, timeout=60)
        assert reply.status_code == 401, (path, reply.text)
        assert reply.json()["error"]["code"] == "invalid_api_key" and "--api-key" in reply.json()["error"]["message"]


def test_http_serves_with_the_key_and_health_is_open(keyed):
    client = openai.OpenAI(base_url=f"{keyed.http_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            temperature=0)
    assert answer.choices[0].message.content and answer.model == MODEL
    assert requests.get(f"{keyed.http_url}/health", timeout=30).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed.http_url}/v1", api_key="nope", max_retries=0).models.list()


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", KEY])
def test_grpc_refuses_without_the_key(keyed, authorization):
    request = pb.GenerateRequest(text="Hi", stopping=pb.StoppingOptions(max_new_tokens=2))
    with grpc.insecure_channel(keyed.target) as channel:
        with pytest.raises(grpc.RpcError) as streamed:
            list(stub(channel).Generate(request, metadata=_metadata(authorization), timeout=60))
        assert streamed.value.code() == grpc.StatusCode.UNAUTHENTICATED and "--api-key" in streamed.value.details()
        with pytest.raises(grpc.RpcError) as unary:
            stub(channel).ModelInfo(model_info_pb2.ModelInfoRequest(), metadata=_metadata(authorization), timeout=60)
        assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_serves_with_the_key_and_health_and_metrics_are_open(keyed):
    request = pb.GenerateRequest(text="Hi", stopping=pb.StoppingOptions(max_new_tokens=2))
    with grpc.insecure_channel(keyed.target) as channel:
        frames = list(stub(channel).Generate(request, metadata=_metadata(f"Bearer {KEY}"), timeout=60))
        assert frames and health(channel) == 1  # SERVING, asked without a key
        with pytest.raises(grpc.RpcError):
            model_info(channel)  # the helper sends no key
    with urllib.request.urlopen(f"http://127.0.0.1:{keyed.metrics_port}/metrics", timeout=30) as reply:
        assert reply.status == 200 and b"vllm:" in reply.read()
    assert "serving SmolLM2-135M-Instruct" in keyed.log() and KEY not in keyed.log()


def _preflight(server, origin: str) -> requests.Response:
    return requests.options(f"{server.http_url}/v1/chat/completions", timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_preflight_and_replies_follow_the_rule(keyed):
    allowed = _preflight(keyed, APP)
    assert allowed.status_code == 200, allowed.text  # answered before the key is asked for
    assert allowed.headers["access-control-allow-origin"] == APP
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert set(allowed.headers["access-control-allow-headers"].lower().replace(" ", "").split(",")) \
        >= {"authorization", "content-type"}
    assert _preflight(keyed, "https://elsewhere.example").status_code == 400  # not an allowed origin
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    served = requests.post(f"{keyed.http_url}/v1/chat/completions", json=body, timeout=120,
                           headers={"Origin": APP, "Authorization": f"Bearer {KEY}"})
    assert served.status_code == 200 and served.headers["access-control-allow-origin"] == APP
    refused = requests.post(f"{keyed.http_url}/v1/chat/completions", json=body, timeout=60, headers={"Origin": APP})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == APP
    other = requests.get(f"{keyed.http_url}/health", timeout=30, headers={"Origin": "https://elsewhere.example"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_root_path_serves_with_and_without_the_prefix(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    for prefix in ("/llm", ""):
        models = requests.get(f"{keyed.http_url}{prefix}/v1/models", headers=auth, timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL, prefix
        assert requests.get(f"{keyed.http_url}{prefix}/health", timeout=30).status_code == 200, prefix
        assert requests.get(f"{keyed.http_url}{prefix}/load", timeout=30).json() == {"server_load": 0}, prefix
        assert requests.get(f"{keyed.http_url}{prefix}/v1/models", timeout=30).status_code == 401, prefix
    assert requests.get(f"{keyed.http_url}/llmx/v1/models", headers=auth, timeout=30).status_code == 404
