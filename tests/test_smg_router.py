"""Two real pagedserve replicas behind the real SMG binary (PyPI `smg`), speaking vllm.grpc.engine.VllmEngine.

SMG tokenizes and renders the chat template itself and sends token ids; these tests check the tokens that come
back equal the offline engine's greedy tokens, that SMG's cache-aware policy keeps a shared prefix on one replica
(counted from each replica's own metrics), that SMG's Abort frees the engine when an HTTP client goes away, and
that bad input through the new service is refused by field name while the server keeps serving.
"""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import grpc
import jsonschema
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc

from mesh_fixtures import SMG_MODEL as MODEL
from service_fixtures import metric_value, off_main_thread, start_server, wait_until
from smg_fixtures import (PERSON, WEATHER_TOOL, _abort_calls, _constrained, _generate, _idle,  # noqa: F401
                          _offline, _post, _sse, engine_stub, replicas, smg)

from pagedserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(900)


# --- through SMG -----------------------------------------------------------------------------------------------


def test_chat_and_completions_through_smg_match_the_offline_engine(smg, llm_fp32):  # noqa: F811
    tok = llm_fp32.tokenizer
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    chat_ids = tok.apply_chat_template(messages)
    expected = _offline(llm_fp32, chat_ids, 12)
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    plain = _post(f"{smg.base}/v1/chat/completions", body)
    assert plain["usage"]["prompt_tokens"] == len(chat_ids)  # SMG sent the token ids the offline engine got
    assert plain["usage"]["completion_tokens"] == len(expected)
    assert plain["choices"][0]["message"]["content"] == tok.decode(expected)

    chunks = _sse(smg.base, body)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert streamed == tok.decode(expected)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] == "length"

    prompt = "The three primary colours are"
    ids = tok.encode(prompt)
    completion = _post(f"{smg.base}/v1/completions",
                       {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
    assert completion["usage"]["prompt_tokens"] == len(ids)
    assert completion["choices"][0]["text"] == tok.decode(_offline(llm_fp32, ids, 10))


def test_stop_strings_and_sampled_requests_through_smg(smg, llm_fp32):  # noqa: F811
    prompt = "List some fruits: apple, banana, cherry"
    expected = off_main_thread(llm_fp32.generate, llm_fp32.tokenizer.encode(prompt),
                               SamplingParams(temperature=0, max_tokens=24, stop=("e",)))[0].outputs[0]
    got = _post(f"{smg.base}/v1/completions",
                {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": ["e"]})["choices"][0]
    assert (got["text"], got["finish_reason"]) == (expected.text, "stop")
    sampled = _post(f"{smg.base}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8, "n": 2,
                                                  "temperature": 0.9, "top_p": 0.9, "seed": 3, "ignore_eos": True})
    direct = off_main_thread(llm_fp32.generate, llm_fp32.tokenizer.encode(prompt), SamplingParams(
        n=2, temperature=0.9, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True))[0].outputs
    # The seed reaches the engine: the same samples as the offline engine's, and the two samples differ.
    assert sorted((c["index"], c["text"]) for c in sampled["choices"]) == [(c.index, c.text) for c in direct]
    assert direct[0].text != direct[1].text and sampled["usage"]["completion_tokens"] == 16


def test_cache_aware_routing_keeps_a_shared_prefix_on_one_replica(smg, replicas):  # noqa: F811
    system = "You are a meticulous assistant for a bakery. " + " ".join(
        f"Rule {i}: answer politely and mention the daily bread number {i}." for i in range(18))
    before = [metric_value(s, "vllm:request_success_total") for s in replicas]
    hits_before = [metric_value(s, "vllm:prefix_cache_hits_total") for s in replicas]
    event_hits_before = smg.metric("smg_cache_aware_policy_branch_total", 'branch="event_hit"')
    for user in range(6):
        _post(f"{smg.base}/v1/chat/completions", {
            "model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {user}?"}]})
    served = [metric_value(s, "vllm:request_success_total") - b for s, b in zip(replicas, before)]
    hits = [metric_value(s, "vllm:prefix_cache_hits_total") - b for s, b in zip(replicas, hits_before)]
    assert sorted(served) == [0, 6], f"requests per replica: {served}"
    busy = served.index(6)
    assert hits[busy] >= 5 * 160, f"prefix-cache hit tokens per replica: {hits}"  # >= 10 blocks per follow-up
    # SMG chose the replica from the KV events it indexed (not from its own guess of what each replica holds).
    assert smg.metric("smg_cache_aware_policy_branch_total", 'branch="event_hit"') - event_hits_before >= 5


def test_client_disconnect_reaches_the_engine_as_smg_abort(smg, replicas):  # noqa: F811
    aborts_before = sum(_abort_calls(s) for s in replicas)
    host, port = smg.base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": MODEL, "stream": True, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse."}]}),
        {"content-type": "application/json"})
    response = conn.getresponse()
    seen = 0
    while seen < 4:  # a few tokens in: the request is running on a replica
        if response.readline().startswith(b"data: "):
            seen += 1
    assert sum(metric_value(s, "vllm:num_requests_running") for s in replicas) == 1
    conn.sock.close()
    conn.close()
    gone_at = time.monotonic()
    # The bound only stops a hang; the elapsed time is reported, not asserted (the box is shared).
    wait_until(lambda: all(_idle(s) for s in replicas), 30, "running requests and used blocks back to 0")
    print(f"replicas idle {time.monotonic() - gone_at:.3f}s after the client disconnected")
    wait_until(lambda: sum(_abort_calls(s) for s in replicas) > aborts_before, 30, "SMG's Abort RPC")


def test_openai_structured_outputs_at_smg_constrain_the_replicas(smg, replicas):  # noqa: F811
    """SMG turns response_format into the json_schema constraint of vllm.grpc.engine and builds a forced tool call's
    schema itself; the replicas compile and apply both (their counters), and what comes back validates."""
    before = _constrained(replicas)
    messages = [{"role": "user", "content": "Give me a JSON object describing a person."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 96, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    whole = _post(f"{smg.base}/v1/chat/completions", body)["choices"][0]
    assert whole["finish_reason"] == "stop"
    jsonschema.validate(json.loads(whole["message"]["content"]), PERSON)
    chunks = _sse(smg.base, body)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")) == \
        whole["message"]["content"]
    json_object = _post(f"{smg.base}/v1/chat/completions", {**body, "response_format": {"type": "json_object"},
                                                             "messages": [{"role": "user", "content":
                                                                           "Is Paris in France? Answer as JSON."}]})
    assert isinstance(json.loads(json_object["choices"][0]["message"]["content"]), dict)
    call = _post(f"{smg.base}/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "max_tokens": 96, "temperature": 0, "tools": [WEATHER_TOOL], "tool_choice": "required"})["choices"][0]
    assert call["finish_reason"] == "tool_calls"
    (tool_call,) = call["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(tool_call["function"]["arguments"]), WEATHER_TOOL["function"]["parameters"])
    assert _constrained(replicas) == before + 4


# --- the VllmEngine service directly ----------------------------------------------------------------------------


@pytest.mark.parametrize("sampling, field", [
    ({"regex": "("}, "sampling_params.regex"),
    ({"json_schema": "[1]"}, "sampling_params.json_schema"),
    ({"prompt_logprobs": -1}, "sampling_params.prompt_logprobs"),
    ({"prompt_logprobs": 21}, "sampling_params.prompt_logprobs"),
    ({"logprobs": -1}, "sampling_params.logprobs"),
    ({"top_p": 3.0}, "sampling_params.top_p"),
    ({"stop_token_ids": [10**6]}, "sampling_params.stop_token_ids"),
])
def test_unsupported_or_bad_sampling_fields_name_the_field(engine_stub, sampling, field):  # noqa: F811
    with pytest.raises(grpc.RpcError) as err:
        _generate(engine_stub, [1, 2, 3], max_tokens=2, **sampling)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()


def test_bad_prompts_and_unknown_fields_then_the_server_keeps_serving(engine_stub, replicas):  # noqa: F811
    cases = [
        (vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[1, 49152])), "tokenized.input_ids[1]"),
        (vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[5] * 600)), "tokenized.input_ids"),
        (vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[1, 2]),
                             sampling_params=vpb.SamplingParams(max_tokens=600)), "sampling_params.max_tokens"),
        (vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[1, 2]), kv_transfer_params_json="{}"),
         "kv_transfer_params_json"),
    ]
    for request, field in cases:
        with pytest.raises(grpc.RpcError) as err:
            list(engine_stub.Generate(request, timeout=60))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field), err.value.details()
    # A field number this proto does not define (a newer router's field): refused, not ignored.
    sampling = vpb.SamplingParams(max_tokens=2).SerializeToString() + b"\xf8\x06\x01"  # field 111, varint 1
    raw = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[1, 2])).SerializeToString()
    raw += b"\x22" + bytes([len(sampling)]) + sampling  # field 4 (sampling_params), length-delimited
    with grpc.insecure_channel(replicas[0].target) as channel:
        generate = channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate", request_serializer=None,
                                        response_deserializer=vpb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(generate(raw, timeout=60))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("sampling_params: unknown field number(s) [111]"), err.value.details()
    assert engine_stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy
    assert _generate(engine_stub, [1, 2, 3], max_tokens=2, temperature=0)[-1].complete.completion_tokens == 2


def test_stream_and_unary_replies_carry_tokens_and_logprobs(engine_stub, llm_fp32):  # noqa: F811
    ids = llm_fp32.tokenizer.encode("Once upon a time")
    expected = _offline(llm_fp32, ids, 6)
    streamed = _generate(engine_stub, ids, stream=True, max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    assert [t for r in streamed[:-1] for t in r.chunk.token_ids] == expected
    assert all(len(r.chunk.output_logprobs.top_logprobs[0].token_ids) == 2 for r in streamed[:-1])
    assert streamed[-1].complete.finish_reason == "length" and not streamed[-1].complete.output_ids
    unary = _generate(engine_stub, ids, max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    assert len(unary) == 1 and list(unary[0].complete.output_ids) == expected
    assert list(unary[0].complete.output_logprobs.token_ids) == expected


def test_prompt_logprobs_come_as_input_logprobs_once(engine_stub, llm_fp32):  # noqa: F811
    ids = llm_fp32.tokenizer.encode("The capital of France is Paris, and of Italy")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    expected = off_main_thread(llm_fp32.generate, [ids], params)[0].prompt_logprobs
    streamed = _generate(engine_stub, ids, stream=True, max_tokens=4, temperature=0, ignore_eos=True,
                         prompt_logprobs=2)
    unary = _generate(engine_stub, ids, max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    with_input = [r.chunk.input_logprobs for r in streamed[:-1] if r.chunk.HasField("input_logprobs")]
    assert len(with_input) == 1 and streamed[0].chunk.HasField("input_logprobs")  # the first chunk only
    for scored in (with_input[0], unary[0].complete.input_logprobs):
        assert list(scored.token_ids) == ids and not scored.token_logprobs[0].HasField("value")
        for lp, top, want in zip(scored.token_logprobs[1:], scored.top_logprobs[1:], expected[1:]):
            assert abs(lp.value - want.logprob) < 2e-3 and len(top.token_ids) == 2
            assert list(top.token_ids) == [t for t, _ in want.top] or abs(top.values[0] - top.values[1]) < 2e-3


def test_info_loads_and_unimplemented(engine_stub, replicas):  # noqa: F811
    info = engine_stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
    assert info.vocab_size == 49152 and info.max_context_length == 512 and info.is_generation
    assert Path(info.tokenizer_path, "tokenizer.json").is_file()
    server = engine_stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
    assert server.block_size == 16 and server.data_parallel_size == 1
    load = engine_stub.GetLoads(vpb.GetLoadsRequest(), timeout=10).loads[0]
    assert load.num_running_reqs == metric_value(replicas[0], "vllm:num_requests_running")
    assert load.num_waiting_reqs == metric_value(replicas[0], "vllm:num_requests_waiting")
    assert load.token_usage == pytest.approx(metric_value(replicas[0], "vllm:kv_cache_usage_perc"))
    assert metric_value(replicas[0], "vllm:cache_config_info") == 1
    with pytest.raises(grpc.RpcError) as err:
        engine_stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=[1, 2])), timeout=10)
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED and "--runner pooling" in err.value.details()


def test_get_tokenizer_streams_the_model_folders_tokenizer_files(engine_stub, default_model):  # noqa: F811
    import hashlib
    import io
    import zipfile

    chunks = list(engine_stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(c.sha256 for c in chunks[:-1])
    archive = zipfile.ZipFile(io.BytesIO(data))
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(archive.namelist())
    assert archive.read("tokenizer.json") == (default_model.tokenizer_dir / "tokenizer.json").read_bytes()
    assert not any(name.endswith(".safetensors") for name in archive.namelist())


def test_kv_events_stream_stored_blocks_with_their_chain(engine_stub):  # noqa: F811
    events = engine_stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=120)
    first = next(events)
    assert first.snapshot.count == 1 and first.events[0].WhichOneof("data") == "cleared"
    ids = list(range(1000, 1040))  # 2 full blocks of 16 and a partial one
    _generate(engine_stub, ids, max_tokens=1, temperature=0)
    stored: list[common_pb2.KvBlocksStored] = []
    while not any(list(s.blocks[0].token_ids) == ids[16:32] for s in stored):
        batch = next(events)
        stored += [e.stored for e in batch.events if e.WhichOneof("data") == "stored"]
    by_tokens = {tuple(s.blocks[0].token_ids): s for s in stored}
    head, second = by_tokens[tuple(ids[:16])], by_tokens[tuple(ids[16:32])]
    assert not head.HasField("parent_block_hash") and head.blocks[0].block_size == 16
    assert second.parent_block_hash == head.blocks[0].block_hash
    # FlushCache: the subscriber is told every block left; a new subscriber's snapshot is empty.
    assert engine_stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=30).success
    removed: set[int] = set()
    while not {head.blocks[0].block_hash, second.blocks[0].block_hash} <= removed:
        removed.update(h for e in next(events).events if e.WhichOneof("data") == "removed"
                       for h in e.removed.block_hashes)
    events.cancel()
    fresh = engine_stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)
    assert next(fresh).snapshot.blocks == 0
    fresh.cancel()


def test_reflection_lists_the_service_and_the_flag_turns_it_off(replicas, tmp_path):  # noqa: F811
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from conftest import make_tiny_model
    from service_fixtures import model_info

    def services(target: str) -> set[str]:
        with grpc.insecure_channel(target) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            reply = next(stub.ServerReflectionInfo(iter([request]), timeout=30))
            return {s.name for s in reply.list_services_response.service}

    assert "vllm.grpc.engine.VllmEngine" in services(replicas[0].target)
    server = start_server(tmp_path / "off", "--model", str(make_tiny_model(tmp_path / "tiny")),
                          "--no-vllm-engine-service")
    try:
        assert "vllm.grpc.engine.VllmEngine" not in services(server.target)
        with grpc.insecure_channel(server.target) as channel:
            assert model_info(channel).vocab_size == 49152  # pagedserve.v1 still serves
            with pytest.raises(grpc.RpcError) as err:
                vgrpc.VllmEngineStub(channel).HealthCheck(vpb.HealthCheckRequest(), timeout=10)
            assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop()


def test_abort_from_another_connection_ends_the_stream(replicas):  # noqa: F811
    request = vpb.GenerateRequest(request_id="abort-me", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]),
                                  stream=True, sampling_params=vpb.SamplingParams(max_tokens=300, ignore_eos=True))
    with grpc.insecure_channel(replicas[1].target) as streaming, grpc.insecure_channel(replicas[1].target) as other:
        replies = vgrpc.VllmEngineStub(streaming).Generate(request, timeout=300)
        assert next(replies).chunk.token_ids  # running
        vgrpc.VllmEngineStub(other).Abort(vpb.AbortRequest(request_ids=["abort-me"]), timeout=30)
        rest = list(replies)
    assert rest[-1].complete.finish_reason == "abort"
    assert rest[-1].complete.completion_tokens < 300
    wait_until(lambda: _idle(replicas[1]), 30, "the aborted request's blocks freed")
