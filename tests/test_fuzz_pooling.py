"""Property-based fuzzing of an embedding model's HTTP routes over a real socket: /v1/embeddings, /score, /rerank
(at each of their paths), /tokenize and /detokenize, with parameters legal, out of range or of the wrong JSON type,
sent beside a pagedserve.v1 Embed bystander in the same batch; pagedserve.v1's Embed, Rerank and Tokenize with every
field fuzzed; and raw garbage bodies on every POST route the generation suite (test_fuzz_http.py) does not cover.

Each example checks: the status is one the routes document (HTTP 200, 400, 404, 413, 429, never 5xx; gRPC codes as
in fuzz_support.DOCUMENTED_CODES); a 400 or INVALID_ARGUMENT names a field of the request; a 200 has the shape the
body asked for (a vector per input of the asked size, a score per document, top_n results best first, as many token
ids as `count`); the bystander's vector equals its solo run; afterwards no request runs, no KV block is held and the
server still serves. Budget and replay: fuzz_support.py.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json

import grpc
import pytest
from fuzz_support import (
    ANY_JSON, check_http_status, check_outcome, fuzz_settings, garbage_never_breaks_the_route, plausible, post,
    run_beside_a_bystander,
)
from hypothesis import event, given
from hypothesis import strategies as st
from service_fixtures import engine_idle, model_info, pooling_server, stub, wait_until  # noqa: F401 - fixture
from test_fuzz_grpc import REQUEST_ID, UINT32
from test_fuzz_http import MESSAGE, TOOLS

from pagedserve.client import Client
from pagedserve.v1 import embed_pb2, generate_pb2, tokenize_pb2

MODEL = "SmolLM2-135M-Instruct"
BYSTANDER = "Name three colours:"
SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
TEXTS = plausible("Paris", "", ["a", "b"], [], ["x"] * 3, ["a", 5], [{"type": "image_url"}], "word " * 600)
COMMON = {
    "model": st.sampled_from([MODEL, MODEL, MODEL, "no-such-model", 7]),
    "priority": plausible(0, 1, -1, 2**70),
    "truncate_prompt_tokens": plausible(None, -1, 0, 1, 4, -2, 10**9, 1.5),
    "user": plausible("u1"),
    "request_id": plausible("r1", "", 5),
    "unknown_field_x": ANY_JSON,
}
EMBED_PARAMS = {
    **COMMON,
    "input": plausible("Hi", "", ["a", "b"], [1, 2, 3], [[1, 2], [3]], [], [-1], [[]], [10**7], [True],
                       "word " * 600, ["x"] * 2049),
    "encoding_format": plausible("float", "base64", None, "int8"),
    "dimensions": plausible(None, 0, 8, 576, -1, 2**40),
    "normalize": plausible(None, True, False, "yes"),
    "add_special_tokens": plausible(True, False),
}
SCORING = {
    **COMMON,
    "max_tokens_per_query": plausible(0, 1, 4, -1, 10**9, "x"),
    "max_tokens_per_doc": plausible(0, 1, 4, -1, 10**9, 2.5),
    "use_activation": plausible(None, True, False),
}
SCORE_PARAMS = {**SCORING, **{name: TEXTS for name in ("queries", "documents", "items", "data_1", "data_2",
                                                      "text_1", "text_2")}}
RERANK_PARAMS = {**SCORING, "query": plausible("Paris", "", ["a"]), "documents": TEXTS,
                 "top_n": plausible(None, 0, 1, 2, -1, 10**9, True), "return_documents": plausible(True, False)}
TOKENIZE_PARAMS = {
    "model": COMMON["model"],
    "prompt": plausible("Hi", "", None, 5, "word " * 600),
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), ANY_JSON),
    "tools": st.one_of(plausible(None, [], [{"type": "function"}]), TOOLS),
    "add_special_tokens": plausible(True, False),
    "add_generation_prompt": plausible(True, False),
    "continue_final_message": plausible(True, False),
    "chat_template_kwargs": plausible(None, {}, {"enable_thinking": False}, [1]),
    "return_token_strs": plausible(True, False),
}
DETOKENIZE_PARAMS = {"model": COMMON["model"], "tokens": plausible([], [1, 2], [-1], [10**7], [True], "x", [2**70])}
ROUTES = {"/v1/embeddings": (EMBED_PARAMS, {"input": "Hi"}),
          **{path: (SCORE_PARAMS, {"queries": "Paris", "documents": ["a", "b"]}) for path in SCORE_PATHS},
          **{path: (RERANK_PARAMS, {"query": "Paris", "documents": ["a", "b"]}) for path in RERANK_PATHS},
          "/tokenize": (TOKENIZE_PARAMS, {"prompt": "Hi"}), "/detokenize": (DETOKENIZE_PARAMS, {"tokens": [1, 2]})}


TEXT = st.one_of(st.sampled_from(["Paris", "", "word " * 600]), st.text(max_size=40))
INT32 = st.one_of(st.integers(-2, 2), st.integers(-(2**31), 2**31 - 1))
EMBED_INPUT = st.builds(
    lambda text, ids, special: embed_pb2.EmbedInput(
        **({"text": text} if ids is None else {"token_ids": generate_pb2.TokenIds(ids=ids)}),
        **({} if special is None else {"add_special_tokens": special})),
    TEXT, st.one_of(st.none(), st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 2**32 - 1)), max_size=40)),
    st.one_of(st.none(), st.booleans()))
OPTIONAL_UINT32 = st.one_of(st.none(), UINT32)
EMBED = st.builds(
    lambda inputs, normalize, dims, cut, adapter, rid, priority: embed_pb2.EmbedRequest(
        inputs=inputs, adapter=adapter, request_id=rid, priority=priority,
        **{k: v for k, v in (("normalize", normalize), ("dimensions", dims), ("truncate_input_tokens", cut))
           if v is not None}),
    st.lists(EMBED_INPUT, max_size=4), st.one_of(st.none(), st.booleans()), st.one_of(st.sampled_from([8, 576]),
                                                                                      OPTIONAL_UINT32),
    OPTIONAL_UINT32, st.sampled_from(["", "", "no-such-adapter"]), REQUEST_ID, INT32)
RERANK = st.builds(embed_pb2.RerankRequest, query=TEXT, documents=st.lists(TEXT, max_size=4), top_n=UINT32,
                   max_tokens_per_query=UINT32, max_tokens_per_doc=UINT32,
                   adapter=st.sampled_from(["", "", "no-such-adapter"]), request_id=REQUEST_ID, priority=INT32)
TOKENIZE = st.builds(tokenize_pb2.TokenizeRequest, text=TEXT, add_special_tokens=st.booleans(),
                     return_offsets=st.booleans())


@st.composite
def bodies(draw) -> tuple[str, dict]:
    path = draw(st.sampled_from(sorted(ROUTES)))
    params, defaults = ROUTES[path]
    body = {"model": MODEL}
    for name in draw(st.lists(st.sampled_from(sorted(params)), max_size=5, unique=True)):
        body[name] = draw(params[name])
    for name, value in defaults.items():
        body.setdefault(name, value)
    return path, body


@pytest.fixture(scope="module")
def embed_server(pooling_server):  # noqa: F811 - the session's one embedding server (service_fixtures.py)
    return pooling_server


@pytest.fixture(scope="module")
def channel(embed_server) -> grpc.Channel:
    with grpc.insecure_channel(embed_server.target) as ch:
        yield ch


def _bystander(target: str) -> tuple[float, ...]:
    with Client(target) as client:
        return client.embed(BYSTANDER, timeout=300)[0].values


def check_reply(path: str, body: dict, status: int, payload: bytes, width: int) -> None:
    check_http_status(body, status, payload)
    if status != 200:
        return
    reply = json.loads(payload)
    if path == "/v1/embeddings":
        _check_embeddings(body, reply, width)
    elif path in SCORE_PATHS:
        documents = next(body[b] for a, b in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                                              ("text_1", "text_2")) if a in body and b in body)
        assert len(reply["data"]) == (len(documents) if isinstance(documents, list) else 1), (reply, body)
    elif path in RERANK_PATHS:
        documents = body["documents"] if isinstance(body["documents"], list) else [body["documents"]]
        top_n = body.get("top_n") or len(documents)
        scores = [r["relevance_score"] for r in reply["results"]]
        assert len(scores) == min(top_n, len(documents)) and scores == sorted(scores, reverse=True), (reply, body)
    elif path == "/tokenize":
        assert reply["count"] == len(reply["tokens"]) and all(isinstance(t, int) for t in reply["tokens"]), reply
    else:
        assert isinstance(reply["prompt"], str), reply


def _check_embeddings(body: dict, reply: dict, width: int) -> None:
    inputs = body["input"]
    count = 1 if isinstance(inputs, str) or all(isinstance(v, int) for v in inputs) else len(inputs)
    assert [d["index"] for d in reply["data"]] == list(range(count)), (reply, body)
    want = body.get("dimensions") or width
    for item in reply["data"]:
        vector = item["embedding"]
        size = len(base64.b64decode(vector)) // 4 if body.get("encoding_format") == "base64" else len(vector)
        assert size == want, (size, want, body)


def test_fuzzed_pooling_bodies_never_harm_a_bystander(embed_server, channel):
    alone = _bystander(embed_server.target)
    width = model_info(channel).embedding_size
    pool = concurrent.futures.ThreadPoolExecutor(4)

    @fuzz_settings()
    @given(st.lists(bodies(), min_size=1, max_size=3))
    def run(requests: list[tuple[str, dict]]) -> None:
        bystander = pool.submit(_bystander, embed_server.target)
        replies = list(pool.map(lambda r: post(embed_server.http_port, r[0], json.dumps(r[1]).encode()), requests))
        for (path, body), (status, payload) in zip(requests, replies):
            event(f"{path} {status}")  # --hypothesis-show-statistics: how often each route got past validation
            check_reply(path, body, status, payload, width)
        assert max(abs(a - b) for a, b in zip(bystander.result(), alone)) < 1e-5
        wait_until(lambda: engine_idle(channel), 60, "every fuzzed request to leave the engine")

    run_beside_a_bystander(run, pool, channel)


def _rpc_outcome(channel: grpc.Channel, request) -> tuple[grpc.StatusCode, str, object]:
    method = {embed_pb2.EmbedRequest: stub(channel).Embed, embed_pb2.RerankRequest: stub(channel).Rerank,
              tokenize_pb2.TokenizeRequest: stub(channel).Tokenize}[type(request)]
    try:
        return grpc.StatusCode.OK, "", method(request, timeout=120)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None


def check_rpc_reply(request, reply, width: int) -> None:
    if isinstance(request, embed_pb2.EmbedRequest):
        want = request.dimensions if request.HasField("dimensions") and request.dimensions else width
        assert [len(e.values) for e in reply.embeddings] == [want] * len(request.inputs), (reply, request)
    elif isinstance(request, embed_pb2.RerankRequest):
        scores = [r.relevance_score for r in reply.results]
        top_n = request.top_n or len(request.documents)
        assert len(scores) == min(top_n, len(request.documents)) and scores == sorted(scores, reverse=True)
    else:
        assert not request.return_offsets or len(reply.offsets) == len(reply.token_ids), reply


def test_fuzzed_embed_rerank_tokenize_rpcs_never_harm_a_bystander(embed_server, channel):
    alone = _bystander(embed_server.target)
    width = model_info(channel).embedding_size
    pool = concurrent.futures.ThreadPoolExecutor(4)

    @fuzz_settings()
    @given(st.lists(st.one_of(EMBED, RERANK, TOKENIZE), min_size=1, max_size=3))
    def run(requests: list) -> None:
        bystander = pool.submit(_bystander, embed_server.target)
        outcomes = list(pool.map(lambda r: _rpc_outcome(channel, r), requests))
        for request, (code, details, reply) in zip(requests, outcomes):
            if code == grpc.StatusCode.NOT_FOUND:  # an adapter the server does not hold (docs/lora.md)
                assert request.adapter and details.startswith("adapter: "), details
                continue
            check_outcome(code, details, {f.name for f in request.DESCRIPTOR.fields})
            if code == grpc.StatusCode.OK:
                check_rpc_reply(request, reply, width)
        assert max(abs(a - b) for a, b in zip(bystander.result(), alone)) < 1e-5
        wait_until(lambda: engine_idle(channel), 60, "every fuzzed request to leave the engine")

    run_beside_a_bystander(run, pool, channel)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/score", "/rerank", "/tokenize", "/detokenize",
                                  "/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_raw_garbage_on_pooling_and_admin_routes(embed_server, channel, path):
    garbage_never_breaks_the_route(embed_server.http_port, path, channel, ("/v1/embeddings", {"input": "Hi"}))
