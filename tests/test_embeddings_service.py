"""Embeddings served: a real `--runner pooling` server on the default model, asked by the official `openai` client
(/v1/embeddings, base64 and float), by pagedserve.v1 Embed through the Python client, by the router protocol's
Embed (smg-grpc-proto), through the real SMG binary routing /v1/embeddings to it over that protocol, and by the Go
and Java clients' Embed (their conformance drivers). Every answer is transformers' last hidden state of the same fp32
model, normalized. Scores and rankings (vLLM's /score and /rerank, the official `cohere` client's /v2/rerank,
pagedserve.v1 Rerank from Python, Go and Java) are the cosine similarities of those vectors. The other task's APIs,
and bad inputs, are refused naming what to fix."""

from __future__ import annotations

import base64
import struct

import cohere
import grpc
import openai
import pytest
import torch
from service_fixtures import pooling_server, server_factory, shared_server  # noqa: F401 - fixtures by name
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc
from google.protobuf import json_format
from mesh_fixtures import WARM_EMBEDDING, http_json, start_smg
from test_clients_go_java import Driver, _missing, built_clients  # noqa: F401 - built_clients: a fixture
from test_openai_http_errors import post

from pagedserve.client import Client, ClientError
from pagedserve.client.embeddings import embed_request, rerank_request
from pagedserve.v1 import embed_pb2, generation_service_pb2_grpc

MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "Hi"]
TOLERANCE = 1e-4  # fp32 both sides, normalized vectors (see tests/test_embeddings.py)


@pytest.fixture(scope="module")
def embed_server(pooling_server):  # noqa: F811 - the session's one embedding server (service_fixtures.py)
    return pooling_server


@pytest.fixture(scope="module")
def references(hf_reference):
    model, tok = hf_reference
    ids = [tok.encode(t) for t in TEXTS]
    with torch.no_grad():
        hidden = [model.model(torch.tensor([p])).last_hidden_state[0, -1] for p in ids]
    return ids, [torch.nn.functional.normalize(h, dim=0) for h in hidden]


def close(values, reference: torch.Tensor) -> bool:
    got = torch.tensor(list(values), dtype=torch.float32)
    return got.shape == reference.shape and (got - reference).abs().max().item() < TOLERANCE


def test_openai_client_embeddings_base64_and_float(embed_server, references):
    ids, refs = references
    oai = openai.OpenAI(base_url=f"{embed_server.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = oai.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert all(close(d.embedding, ref) for d, ref in zip(reply.data, refs))
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(p) for p in ids)
    status, body = post(embed_server.http_port, "/v1/embeddings",
                        {"model": MODEL, "input": ids[1], "encoding_format": "float"})
    assert status == 200 and body["object"] == "list" and body["model"] == MODEL
    assert close(body["data"][0]["embedding"], refs[1])
    status, body = post(embed_server.http_port, "/v1/embeddings", {"input": [ids[2]], "encoding_format": "base64"})
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert close(struct.unpack(f"<{len(raw) // 4}f", raw), refs[2])
    status, body = post(embed_server.http_port, "/v1/embeddings", {"input": TEXTS[0], "normalize": False})
    assert status == 200 and abs(sum(v * v for v in body["data"][0]["embedding"]) - 1.0) > 1e-3


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ["ok", {"text": "no"}]}, "input[1]"),
    ({"input": [[1, 2], [10**7]]}, "input[1][0]"),
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "normalize": "yes"}, "normalize"),
    ({"input": "x " * 600}, "input[0]"),
    ({"input": "x", "model": 7}, "model"),  # not served as the base model: refused as the generate routes refuse it
])
def test_bad_embedding_requests_name_the_parameter(embed_server, body, param):
    status, reply = post(embed_server.http_port, "/v1/embeddings", {"model": MODEL, **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply


def test_truncation_fits_a_long_input(embed_server):
    status, body = post(embed_server.http_port, "/v1/embeddings",
                        {"input": "x " * 600, "truncate_prompt_tokens": -1, "encoding_format": "float"})
    assert status == 200 and body["usage"]["prompt_tokens"] == 512
    status, body = post(embed_server.http_port, "/v1/embeddings", {"input": "x", "encoding_format": None})
    assert status == 200 and isinstance(body["data"][0]["embedding"], list)  # null is the default: float


def test_v1_embed_and_model_info(embed_server, references):
    ids, refs = references
    with Client(embed_server.target) as client:
        info = client.model_info()
        assert (info.runner, info.pooling_type, info.embedding_size) == ("pooling", "LAST", 576)
        got = client.embed([TEXTS[0], ids[1]])
        assert [e.prompt_tokens for e in got] == [len(ids[0]), len(ids[1])]
        assert close(got[0].values, refs[0]) and close(got[1].values, refs[1])
        with pytest.raises(ClientError) as info:
            client.embed([TEXTS[0], [10**7]])
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "inputs[1].token_ids.ids[0]" in str(info.value)
        with pytest.raises(ClientError) as info:
            list(client.generate("Hi", max_new_tokens=2))
        assert info.value.code == grpc.StatusCode.UNIMPLEMENTED and "embedding model" in str(info.value)
    status, body = post(embed_server.http_port, "/v1/chat/completions",
                        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 400 and "embedding model" in body["error"]["message"]


QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital and largest city of France.", "The mitochondrion is the powerhouse of the cell.",
             "Berlin is the capital of Germany.", "France's capital, Paris, lies on the Seine."]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


@pytest.fixture(scope="module")
def scores(hf_vector):
    """Each document's cosine similarity to QUERY (transformers' vectors), and the documents best first."""
    expected = [cosine(hf_vector(QUERY), hf_vector(d)) for d in DOCUMENTS]
    return expected, sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])


def test_cohere_client_reranks(embed_server, scores):
    expected, order = scores
    co = cohere.ClientV2(base_url=embed_server.http_url, api_key="unused", timeout=120)
    reply = co.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS, top_n=3)  # POST /v2/rerank
    assert [r.index for r in reply.results] == order[:3]
    assert all(abs(r.relevance_score - expected[r.index]) < TOLERANCE for r in reply.results)
    reply = co.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS)
    assert [r.index for r in reply.results] == order


@pytest.mark.parametrize("path, names", [("/score", ("queries", "documents")), ("/v1/score", ("text_1", "text_2")),
                                         ("/score", ("data_1", "data_2")), ("/score", ("queries", "items"))])
def test_score_pairs_each_spelling(embed_server, scores, hf_vector, path, names):
    expected, _ = scores
    status, body = post(embed_server.http_port, path, {"model": MODEL, names[0]: QUERY, names[1]: DOCUMENTS})
    assert status == 200 and body["object"] == "list" and body["model"] == MODEL, body
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and {d["object"] for d in body["data"]} == {"score"}
    assert max(abs(d["score"] - e) for d, e in zip(body["data"], expected)) < TOLERANCE
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    pairs = [QUERY, DOCUMENTS[2]]  # N:N, query i against document i
    status, body = post(embed_server.http_port, path, {names[0]: pairs, names[1]: pairs[::-1]})
    assert status == 200 and [round(d["score"], 4) for d in body["data"]] == [round(expected[2], 4)] * 2


def test_rerank_top_n_documents_and_token_limits(embed_server, scores, hf_vector, hf_reference):
    expected, order = scores
    _, tok = hf_reference
    status, body = post(embed_server.http_port, "/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS,
                                                            "top_n": 2})
    assert status == 200 and body["model"] == MODEL and body["id"].startswith("rerank-")
    assert [(r["index"], r["document"]["text"]) for r in body["results"]] == [(i, DOCUMENTS[i]) for i in order[:2]]
    status, body = post(embed_server.http_port, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS,
                                                               "return_documents": False, "max_tokens_per_doc": 4})
    offsets = [tok(d, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"] for d in DOCUMENTS]
    cut = [d[:min(o[3][1], o[4][0])] for d, o in zip(DOCUMENTS, offsets)]  # up to where token 4 ends, as vLLM cuts
    assert cut[0] == "Paris is the capital"
    cut_scores = [cosine(hf_vector(QUERY), hf_vector(d)) for d in cut]
    assert status == 200 and all("document" not in r for r in body["results"])
    assert all(abs(r["relevance_score"] - cut_scores[r["index"]]) < TOLERANCE for r in body["results"])
    assert [r["index"] for r in body["results"]] == sorted(range(4), key=lambda i: -cut_scores[i])


def test_integral_floats_in_integer_fields_are_those_integers(embed_server):
    """16.0 as Java's Double or JavaScript's arithmetic writes it: read as vLLM's pydantic models read it."""
    whole = {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "max_tokens_per_doc": 4, "priority": 0}
    as_floats = {**whole, "top_n": 2.0, "max_tokens_per_doc": 4.0, "priority": 0.0, "truncate_prompt_tokens": 64.0}
    _, ints = post(embed_server.http_port, "/rerank", whole)
    status, floats = post(embed_server.http_port, "/rerank", as_floats)
    assert status == 200 and [r["index"] for r in floats["results"]] == [r["index"] for r in ints["results"]]
    assert [r["relevance_score"] for r in floats["results"]] == [r["relevance_score"] for r in ints["results"]]
    status, body = post(embed_server.http_port, "/v1/embeddings", {"input": "x " * 600, "truncate_prompt_tokens": 8.0})
    assert status == 200 and body["usage"]["prompt_tokens"] == 8
    for field in ("top_n", "truncate_prompt_tokens"):
        status, reply = post(embed_server.http_port, "/rerank", {**whole, field: 2.5})
        assert status == 400 and reply["error"]["param"] == field, reply


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"queries": "q"}, "queries"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["x", "y", "z"]}, "text_1"),
    ("/score", {"queries": [], "documents": ["x"]}, "queries"),
    ("/score", {"data_1": "q", "data_2": ["x", {"content": [{"type": "text", "text": "y"}]}]}, "data_2[1]"),
    ("/score", {"queries": "q", "items": ["x", "x " * 600]}, "items[1]"),
    ("/score", {"queries": "q", "documents": "d", "max_tokens_per_doc": 4096}, "max_tokens_per_doc"),
    ("/score", {"queries": "q", "documents": "d", "max_tokens_per_query": -1}, "max_tokens_per_query"),
    ("/rerank", {"query": ["a"], "documents": ["x"]}, "query"),
    ("/rerank", {"query": "x " * 600, "documents": ["x"]}, "query"),
    ("/rerank", {"query": "q"}, "documents"),
    ("/rerank", {"query": "q", "documents": ["x", 7]}, "documents[1]"),
    ("/rerank", {"query": "q", "documents": ["x"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": "q", "documents": ["x"], "return_documents": "no"}, "return_documents"),
    ("/v2/rerank", {"query": "q", "documents": ["x"], "priority": "high"}, "priority"),
    ("/score", {"model": ["m"], "queries": "q", "documents": ["x"]}, "model"),
    ("/v1/rerank", {"model": 1, "query": "q", "documents": ["x"]}, "model"),
])
def test_bad_score_requests_name_the_parameter(embed_server, path, body, param):
    status, reply = post(embed_server.http_port, path, {"model": MODEL, **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply


def test_v1_rerank(embed_server, scores):
    expected, order = scores
    with Client(embed_server.target) as client:
        ranked = client.rerank(QUERY, DOCUMENTS)
        assert [r.index for r in ranked] == order
        assert all(abs(r.relevance_score - expected[r.index]) < TOLERANCE for r in ranked)
        assert [r.index for r in client.rerank(QUERY, DOCUMENTS, top_n=1)] == order[:1]
        for kwargs, field in (({"max_tokens_per_doc": 10**6}, "max_tokens_per_doc"), ({"documents": []}, "documents"),
                              ({"documents": ["ok", "x " * 600]}, "documents[1]"), ({"query": "x " * 600}, "query")):
            with pytest.raises(ClientError) as info:
                client.rerank(**{"query": QUERY, "documents": DOCUMENTS, **kwargs})
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in str(info.value), kwargs
        with pytest.raises(ClientError) as info:  # the request's own field, not HTTP's `model`
            client.rerank(QUERY, DOCUMENTS, adapter="nope")
        assert info.value.code == grpc.StatusCode.NOT_FOUND and info.value.field == "adapter"


@pytest.mark.skipif(bool(_missing), reason=f"Go/Java toolchains absent ({', '.join(_missing)})")
@pytest.mark.parametrize("lang", ["go", "java"])
def test_go_and_java_clients_embed_and_rerank(lang, built_clients, embed_server, references, scores,  # noqa: F811
                                              tmp_path):
    ids, refs = references
    expected, expected_order = scores
    driver = Driver(lang, embed_server.target, tmp_path)
    try:
        reply = driver.call("embed", request=json_format.MessageToDict(embed_request([TEXTS[0], ids[1]])))
        assert reply["error"] is None and reply["prompt_tokens"] == [len(ids[0]), len(ids[1])]
        assert close(reply["embeddings"][0], refs[0]) and close(reply["embeddings"][1], refs[1])
        bad = driver.call("embed", request=json_format.MessageToDict(embed_request([[10**7]])))
        assert bad["error"]["code"] == "INVALID_ARGUMENT" and "inputs[0].token_ids.ids[0]" in bad["error"]["message"]
        ranked = driver.call("rerank", request=json_format.MessageToDict(rerank_request(QUERY, DOCUMENTS, top_n=3)))
        assert ranked["error"] is None and ranked["indices"] == expected_order[:3]
        assert max(abs(g - expected[i]) for g, i in zip(ranked["scores"], ranked["indices"])) < TOLERANCE
        bad = driver.call("rerank", request=json_format.MessageToDict(rerank_request(QUERY, ["x " * 600])))
        assert bad["error"]["code"] == "INVALID_ARGUMENT" and "documents[0]" in bad["error"]["message"]
    finally:
        driver.close()


def test_router_protocol_embed(embed_server, references):
    ids, refs = references
    with grpc.insecure_channel(embed_server.target) as channel:
        stub = vgrpc.VllmEngineStub(channel)
        assert not stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=30).is_generation
        reply = stub.Embed(vpb.EmbedRequest(request_id="e1", tokenized=vpb.TokenizedInput(input_ids=ids[0])),
                           timeout=60)
        assert reply.prompt_tokens == len(ids[0]) and reply.embedding_dim == 576 and close(reply.embedding, refs[0])
        with pytest.raises(grpc.RpcError) as info:
            stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=[10**7])), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokenized.input_ids" in info.value.details()


def test_smg_routes_embeddings_to_the_embedding_server(embed_server, references, default_model, tmp_path):
    ids, refs = references
    router = start_smg(tmp_path / "smg", [embed_server], default_model.tokenizer_dir, warm=WARM_EMBEDDING)
    try:
        (worker,) = http_json(f"{router.base}/workers")["workers"]
        assert worker["models"][0]["model_type"] == ["embeddings"]  # from GetModelInfo.is_generation = false
        # One input per call: SMG 1.13.0 sends a list's inputs as one tokenized prompt (one vector for all of them)
        for text, ids_, ref in zip(TEXTS[:2], ids, refs):
            reply = http_json(f"{router.base}/v1/embeddings", {"model": MODEL, "input": text})
            assert reply["usage"]["prompt_tokens"] == len(ids_) and close(reply["data"][0]["embedding"], ref)
    finally:
        router.stop()


def test_a_generation_server_refuses_embeddings(shared_server):  # noqa: F811
    status, body = post(shared_server.http_port, "/v1/embeddings", {"model": MODEL, "input": "Hi"})
    assert status == 400 and "--runner pooling" in body["error"]["message"]
    for path, body in (("/score", {"queries": "q", "documents": ["d"]}),
                       ("/rerank", {"query": "q", "documents": ["d"]})):
        status, reply = post(shared_server.http_port, path, {"model": MODEL, **body})
        assert status == 400 and "--runner pooling" in reply["error"]["message"], (path, reply)
    with grpc.insecure_channel(shared_server.target) as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        request = embed_pb2.EmbedRequest(inputs=[embed_pb2.EmbedInput(text="Hi")])
        with pytest.raises(grpc.RpcError) as info:
            stub.Embed(request, timeout=60)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as info:
            stub.Rerank(embed_pb2.RerankRequest(query="q", documents=["d"]), timeout=60)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as info:
            vgrpc.VllmEngineStub(channel).Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=[1])),
                                                timeout=60)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
