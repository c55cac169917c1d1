"""The prompt's logprobs over OpenAI HTTP on the shared server, read by the real `openai` client: completions' echo
with logprobs as lm-evaluation-harness sends it to score a continuation, vLLM's prompt_logprobs on completions and
chat. The values themselves are checked against transformers in tests/test_prompt_logprobs.py; here, that each shape
carries the engine's numbers for the right tokens."""

from __future__ import annotations

import openai
import pytest
import requests
from service_fixtures import shared_server  # noqa: F401 - fixture by name
from test_openai_http_errors import CHAT, COMPLETIONS, USER, post

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = "Question: What is the capital of France?\nAnswer:"
# Two requests scoring the same tokens may run on other thread counts (the governor), so sums in other orders.
SAME = 2e-3


@pytest.fixture(scope="module")
def oai(shared_server):  # noqa: F811
    return openai.OpenAI(base_url=f"{shared_server.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _tokens(server, prompt: str) -> list[int]:
    return requests.post(f"{server.http_url}/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]


def test_echo_with_logprobs_scores_a_continuation_as_lm_eval_asks(oai, shared_server):  # noqa: F811
    # lm-eval sends token ids: the context plus the continuation, here the context's best non-special next token
    ids = _tokens(shared_server, CONTEXT)
    no_specials = {str(t): -100 for t in range(3)}
    first = oai.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                   logit_bias=no_specials, extra_body={"return_token_ids": True})
    continuation, generated = first.choices[0].model_extra["token_ids"], first.choices[0].logprobs.token_logprobs[0]
    scored = oai.completions.create(model=MODEL, prompt=ids + continuation, max_tokens=1, temperature=0, logprobs=1,
                                    echo=True)
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    assert abs(lp.token_logprobs[len(ids)] - generated) < SAME  # the continuation's score, as when generated
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == value and len(top) <= 2  # the token itself and the best one


def test_echo_of_a_text_prompt_lists_its_tokens_ahead_of_the_output(oai, shared_server):  # noqa: F811
    reply = oai.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice, n = reply.choices[0], len(_tokens(shared_server, CONTEXT))
    assert choice.text.startswith(CONTEXT)
    assert "".join(choice.logprobs.tokens[:n]) == CONTEXT  # this tokenizer's pieces join to the text
    assert choice.logprobs.text_offset[n] == len(CONTEXT)  # the output's offsets go on from the prompt's
    assert len(choice.logprobs.tokens) == n + reply.usage.completion_tokens


def test_prompt_logprobs_on_completions_carry_rank_and_decoded_token(oai, shared_server):  # noqa: F811
    ids = _tokens(shared_server, CONTEXT)
    echoed = oai.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=1, temperature=0, logprobs=0, echo=True)
    reply = oai.completions.create(model=MODEL, prompt=CONTEXT, max_tokens=1, temperature=0,
                                   extra_body={"prompt_logprobs": 3})
    scores = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    for i, (token, entry) in enumerate(zip(ids[1:], scores[1:]), start=1):
        own = entry[str(token)]
        assert set(own) == {"logprob", "rank", "decoded_token"} and own["rank"] >= 1
        assert abs(own["logprob"] - echoed.choices[0].logprobs.token_logprobs[i]) < SAME
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert len(entry) == (3 if own["rank"] <= 3 else 4)  # the 3 best, and the prompt token if not among them
        assert [e["rank"] for e in ranked][:3] == [1, 2, 3]
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(ranked, ranked[1:]))
    assert reply.choices[0].logprobs is None  # only prompt logprobs were asked for


def test_chat_prompt_logprobs_cover_the_templated_prompt(shared_server):  # noqa: F811
    status, reply = post(shared_server.http_port, CHAT, {"model": MODEL, "messages": USER, "max_tokens": 2,
                                                         "temperature": 0, "prompt_logprobs": 1})
    assert status == 200, reply
    scores = reply["prompt_logprobs"]
    assert len(scores) == reply["usage"]["prompt_tokens"] and scores[0] is None
    assert all(1 <= len(entry) <= 2 for entry in scores[1:])


def test_a_batch_of_prompts_echoes_each_its_own(shared_server):  # noqa: F811
    prompts = ["The sky is", "One, two, three, four"]
    status, reply = post(shared_server.http_port, COMPLETIONS, {"model": MODEL, "prompt": prompts, "max_tokens": 2,
                                                                "temperature": 0, "logprobs": 1, "echo": True, "n": 1})
    assert status == 200, reply
    for prompt, choice in zip(prompts, reply["choices"]):
        n = len(_tokens(shared_server, prompt))
        assert "".join(choice["logprobs"]["tokens"][:n]) == prompt
        assert len(choice["prompt_logprobs"]) == n  # vLLM returns the field whenever the prompt was scored
        assert len(choice["logprobs"]["tokens"]) == n + 2


def test_streams_refuse_the_prompts_logprobs(shared_server):  # noqa: F811
    for path, body, param in ((COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
                              (CHAT, {"messages": USER, "prompt_logprobs": 0}, "prompt_logprobs"),
                              (COMPLETIONS, {"prompt": "x", "echo": True, "logprobs": 1}, "echo")):
        status, reply = post(shared_server.http_port, path, {**body, "model": MODEL, "stream": True})
        assert status == 400 and reply["error"]["param"] == param, reply
