"""The OpenAI HTTP API through the official `openai` client, on the shared server's --http-port: the same greedy
results as pagedserve.v1 and the offline engine, streaming and not, n > 1, stop strings, seeds and logprobs."""

from __future__ import annotations

import http.client
import json
import urllib.request

import openai
import pytest
from service_fixtures import metric_value, off_main_thread, settled_metric_value, shared_server, wait_until  # noqa: F401 - fixtures by name

from pagedserve.client import Client, Message
from pagedserve.engine import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
SYSTEM = "You are a concise assistant."
MODEL = "SmolLM2-135M-Instruct"
GREEDY = dict(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def oai(shared_server) -> openai.OpenAI:  # noqa: F811
    with openai.OpenAI(base_url=f"{shared_server.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(shared_server) -> Client:  # noqa: F811
    with Client(shared_server.target, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def offline(hf_reference):
    """The offline engine (the server's context limit) and transformers' tokenizer, the chat template's oracle."""
    return LLM(max_model_len=512, kv_cache_memory=32 << 20, dtype="float32"), hf_reference[1]


def chat(question: str, system: bool = False) -> list[dict[str, str]]:
    return ([{"role": "system", "content": SYSTEM}] if system else []) + [{"role": "user", "content": question}]


def offline_greedy(offline, prompt: str | list[int], max_tokens: int = 24, **kwargs: object):
    llm, _ = offline
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)
    return off_main_thread(llm.generate, prompt, params)[0].outputs[0]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_grpc_and_offline(oai, grpc_client, offline, prompt):
    got = oai.completions.create(model=MODEL, prompt=prompt, **GREEDY, extra_body={"ignore_eos": True})
    expected = offline_greedy(offline, prompt, ignore_eos=True)
    over_grpc = grpc_client.complete(prompt, temperature=0, max_new_tokens=24, ignore_eos=True)
    assert got.choices[0].text == expected.text == over_grpc.text and expected.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 24 and got.usage.prompt_tokens == len(offline[1](prompt).input_ids)
    assert got.model == MODEL and got.object == "text_completion"


def test_streamed_completion_concatenates_to_the_whole_one(oai, offline):
    stream = oai.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **GREEDY,
                                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1, "one chunk per engine step, not one blob"
    assert "".join(c.choices[0].text for c in text_chunks) == offline_greedy(offline, PROMPTS[0], ignore_eos=True).text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in text_chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(oai):
    """vLLM's return_tokens_as_token_ids: every logprob token, chosen or top, is "token_id:N"; the text is as ever."""
    answer = oai.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[0]), temperature=0, max_tokens=6,
                                         logprobs=True, top_logprobs=2,
                                         extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    ids = answer.choices[0].model_extra["token_ids"]
    content = answer.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in ids] and answer.choices[0].message.content
    assert all(top.token.startswith("token_id:") for c in content for top in c.top_logprobs)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    completion = oai.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=4, logprobs=1,
                                        echo=True, extra_body={"return_tokens_as_token_ids": True})
    tokens = completion.choices[0].logprobs.tokens
    assert tokens and all(t.startswith("token_id:") for t in tokens)  # the echoed prompt's tokens too
    assert completion.choices[0].text.startswith(PROMPTS[0])


def test_load_counts_the_requests_in_flight(oai, shared_server):  # noqa: F811
    """vLLM's /load: a stream open now counts; once it ends the count goes back to what it was."""
    import requests

    def load() -> int:
        return requests.get(f"{shared_server.http_url}/load", timeout=30).json()["server_load"]

    before = load()
    stream = oai.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, temperature=0, max_tokens=64,
                                    extra_body={"ignore_eos": True})
    next(iter(stream))
    assert load() == before + 1
    list(stream)
    wait_until(lambda: load() == before, 30, "the finished stream to leave /load")


def test_cors_allows_any_origin_by_default(shared_server):  # noqa: F811 - vLLM's default rule
    import requests

    reply = requests.get(f"{shared_server.http_url}/v1/models", headers={"Origin": "https://page.example"}, timeout=30)
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "*"
    preflight = requests.options(f"{shared_server.http_url}/v1/completions", timeout=30, headers={
        "Origin": "https://page.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in preflight.headers


def test_continuous_usage_stats_count_each_chunk_only_beside_include_usage(oai):
    """vLLM's rule: with include_usage, continuous_usage_stats puts the running usage on every chunk; alone it
    adds nothing."""
    request = dict(model=MODEL, prompt=PROMPTS[0], stream=True, **GREEDY, extra_body={"ignore_eos": True})
    chunks = list(oai.completions.create(**request, stream_options={"include_usage": True,
                                                                    "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 24 and len(set(counts)) > 1, counts
    assert all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens > 0 for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    alone = list(oai.completions.create(**request, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in alone) and all(c.choices for c in alone)


@pytest.mark.parametrize("question", QUESTIONS)
@pytest.mark.parametrize("system", [False, True], ids=["user", "system+user"])
def test_chat_equals_grpc_and_offline_on_the_same_template(oai, grpc_client, offline, question, system):
    messages = chat(question, system)
    prompt_ids = list(offline[1].apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    expected = offline_greedy(offline, prompt_ids, max_tokens=32)
    got = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_completion_tokens=32)
    over_grpc = grpc_client.complete([Message(**m) for m in messages], temperature=0, max_new_tokens=32)
    assert got.choices[0].message.content == expected.text == over_grpc.text and expected.text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(prompt_ids) == over_grpc.final.usage.prompt_tokens
    assert got.choices[0].finish_reason == ("stop" if expected.finish_reason == "stop" else "length")


def test_streamed_chat_with_n_and_seed_equals_the_whole_response(oai, grpc_client):
    sampled = dict(model=MODEL, messages=chat(QUESTIONS[1]), temperature=1.0, top_p=0.95, seed=1234, n=3,
                   max_tokens=24)
    whole = oai.chat.completions.create(**sampled)
    stream = list(oai.chat.completions.create(**sampled, stream=True))
    texts, roles, finishes = [""] * 3, [None] * 3, [None] * 3
    for chunk in stream:
        for choice in chunk.choices:
            roles[choice.index] = roles[choice.index] or choice.delta.role
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = finishes[choice.index] or choice.finish_reason
    assert texts == [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)]
    assert roles == ["assistant"] * 3 and None not in finishes
    assert len(set(texts)) > 1, "three samples from the same seed stream must differ from each other"
    over_grpc = grpc_client.generate([Message("user", QUESTIONS[1])], temperature=1.0, top_p=0.95, seed=1234, n=3,
                                     max_new_tokens=24).results()
    assert [c.text for c in over_grpc] == texts


def test_stop_string_ends_the_completion_and_is_reported(oai, offline):
    full = offline_greedy(offline, PROMPTS[1], max_tokens=24, ignore_eos=True).text
    stop = full[len(full) // 2:][:3]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        got = oai.completions.create(model=MODEL, prompt=PROMPTS[1], stop=[stop], stream=stream, **GREEDY,
                                     extra_body={"ignore_eos": True})
        choices = [c.choices[0] for c in got if c.choices] if stream else got.choices
        assert "".join(c.text for c in choices) == cut
        assert choices[-1].finish_reason == "stop"
        assert choices[-1].model_extra["stop_reason"] == stop


def test_completion_logprobs_match_grpc(oai, grpc_client):
    got = oai.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=3, **GREEDY)
    over_grpc = grpc_client.complete(PROMPTS[0], temperature=0, max_new_tokens=24, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(over_grpc.token_ids) == 24
    assert lp.token_logprobs == pytest.approx([t.logprob for t in over_grpc.logprobs], abs=1e-5)
    assert "".join(lp.tokens) == got.choices[0].text
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_and_top_logprobs(oai):
    got = oai.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[0]), temperature=0, max_tokens=8,
                                      logprobs=True, top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert got.choices[0].finish_reason == "stop"  # the end-of-turn token is generated, so it has a logprob too
    assert "".join(t.token for t in content) == got.choices[0].message.content + "<|im_end|>"
    for token in content:
        assert len(token.top_logprobs) == 2 and token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.top_logprobs[0].token == token.token  # greedy: the chosen token is the most likely
        assert bytes(token.bytes).decode() == token.token


def test_models_and_health(oai, shared_server):  # noqa: F811
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")
    assert urllib.request.urlopen(f"{shared_server.http_url}/health", timeout=30).status == 200


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-4o", messages=chat("hi"), max_tokens=4)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"


def test_echo_and_token_id_prompts(oai, offline):
    ids = list(offline[1](PROMPTS[0]).input_ids)
    by_ids = oai.completions.create(model=MODEL, prompt=ids, **GREEDY)
    echoed = oai.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPTS[0] + by_ids.choices[0].text
    ids_echoed = oai.completions.create(model=MODEL, prompt=ids, echo=True, **GREEDY)  # the ids decoded, as vLLM
    assert ids_echoed.choices[0].text == offline[1].decode(ids) + by_ids.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_a_batch_of_prompts_answers_each_in_order(oai, offline):
    expected = [offline_greedy(offline, p, ignore_eos=True).text for p in PROMPTS]
    whole = oai.completions.create(model=MODEL, prompt=PROMPTS, **GREEDY, extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == expected
    assert whole.usage.completion_tokens == 24 * len(PROMPTS)
    streamed = [""] * len(PROMPTS)
    for chunk in oai.completions.create(model=MODEL, prompt=PROMPTS, stream=True, **GREEDY,
                                        extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected


def test_x_request_id_is_echoed(shared_server):  # noqa: F811
    conn = http.client.HTTPConnection("127.0.0.1", shared_server.http_port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
                     {"content-type": "application/json", "x-request-id": "trace-42"})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("x-request-id") == "trace-42"
        response.read()
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
                     {"content-type": "application/json", "x-request-id": "has space"})
        response = conn.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 400 and error["param"] == "x-request-id", error
        assert response.getheader("x-request-id") is None, "an invalid id is never echoed"
    finally:
        conn.close()


def test_http_requests_are_counted_with_vllm_metric_names(oai, shared_server):  # noqa: F811
    handled = metric_value(shared_server, "http_server_handled_total")
    gaps = metric_value(shared_server, "vllm:inter_token_latency_seconds_count")
    finished = metric_value(shared_server, "vllm:request_success_total")
    list(oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, stream=True,
                                extra_body={"ignore_eos": True}))
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=-1)
    assert settled_metric_value(shared_server, "http_server_handled_total", handled + 2) == handled + 2
    assert settled_metric_value(shared_server, "vllm:inter_token_latency_seconds_count", gaps + 5) >= gaps + 5
    assert settled_metric_value(shared_server, "vllm:request_success_total", finished + 1) == finished + 1
