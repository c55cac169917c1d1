"""vLLM's request extras on the shared server, each doing what vLLM does with it (not merely accepted): unknown
fields ignored with one warning per name, integral floats in integer fields, truncate_prompt_tokens, allowed_token_ids,
bad_words, skip_special_tokens, chat_template_kwargs, continue_final_message, echo in chat, /tokenize, /detokenize,
/version."""

from __future__ import annotations

import importlib.metadata

import requests
from service_fixtures import shared_server  # noqa: F401 - fixture by name
from test_openai_http_errors import CHAT, COMPLETIONS, USER, post

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0, "max_tokens": 12}


def _ok(server, path: str, body: dict) -> dict:
    status, reply = post(server.http_port, path, body)
    assert status == 200, reply
    return reply


def test_unknown_fields_are_ignored_with_one_warning_per_name(shared_server):  # noqa: F811
    plain = _ok(shared_server, COMPLETIONS, {"prompt": "The sky is", **GREEDY})
    for _ in range(2):
        odd = _ok(shared_server, COMPLETIONS, {"prompt": "The sky is", **GREEDY, "temprature": 0.5,
                                               "x_unknown_flag_17": {"a": 1}})
        assert odd["choices"][0]["text"] == plain["choices"][0]["text"]
    log = shared_server.log()
    assert log.count("ignoring the unknown request field 'temprature'") == 1
    assert log.count("ignoring the unknown request field 'x_unknown_flag_17'") == 1


def test_integral_floats_in_integer_fields_are_those_integers(shared_server):  # noqa: F811
    """As vLLM's pydantic models read them (a client computing max_tokens in floating point sends 16.0); a fraction is
    still refused naming the field."""
    sampled = {"prompt": "The sky is", "temperature": 0.8, "ignore_eos": True, "return_token_ids": True}
    ints = _ok(shared_server, COMPLETIONS, {**sampled, "max_tokens": 6, "n": 2, "seed": 11, "top_k": 20,
                                            "logprobs": 2, "min_tokens": 3})
    floats = _ok(shared_server, COMPLETIONS, {**sampled, "max_tokens": 6.0, "n": 2.0, "seed": 11.0, "top_k": 20.0,
                                              "logprobs": 2.0, "min_tokens": 3.0})
    assert [c["token_ids"] for c in floats["choices"]] == [c["token_ids"] for c in ints["choices"]]
    assert len(floats["choices"]) == 2 and len(floats["choices"][0]["token_ids"]) == 6
    assert len(floats["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
    chat = {"messages": USER, "temperature": 0, "logprobs": True}
    as_floats = _ok(shared_server, CHAT, {**chat, "max_completion_tokens": 4.0, "top_logprobs": 1.0})
    assert as_floats["choices"] == _ok(shared_server, CHAT, {**chat, "max_completion_tokens": 4, "top_logprobs": 1})[
        "choices"] and as_floats["usage"]["completion_tokens"] == 4
    for name in ("max_tokens", "seed", "top_k"):
        status, reply = post(shared_server.http_port, COMPLETIONS, {**sampled, name: 6.5})
        assert (status, reply["error"]["param"]) == (400, name), reply


def test_truncate_prompt_tokens_keeps_the_last_tokens(shared_server):  # noqa: F811
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    whole = _ok(shared_server, COMPLETIONS, {"prompt": prompt, **GREEDY})
    cut = _ok(shared_server, COMPLETIONS, {"prompt": prompt, **GREEDY, "truncate_prompt_tokens": 4})
    tail = requests.post(f"{shared_server.http_url}/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"][-4:]
    same = _ok(shared_server, COMPLETIONS, {"prompt": tail, **GREEDY})
    assert whole["usage"]["prompt_tokens"] > 4 and cut["usage"]["prompt_tokens"] == 4
    assert cut["choices"][0]["text"] == same["choices"][0]["text"]


def test_allowed_token_ids_limit_every_token(shared_server):  # noqa: F811
    allowed = requests.post(f"{shared_server.http_url}/tokenize", json={
        "prompt": " yes no maybe", "add_special_tokens": False}, timeout=30).json()["tokens"]
    reply = _ok(shared_server, COMPLETIONS, {"prompt": "Is Paris in France?", "temperature": 1.0, "seed": 3,
                                             "max_tokens": 16, "allowed_token_ids": allowed, "return_token_ids": True,
                                             "ignore_eos": True})
    assert set(reply["choices"][0]["token_ids"]) <= set(allowed) and len(reply["choices"][0]["token_ids"]) == 16


def test_bad_words_are_never_generated(shared_server):  # noqa: F811
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], **GREEDY, "max_tokens": 24}
    plain = _ok(shared_server, CHAT, body)["choices"][0]["message"]["content"]
    assert "Paris" in plain
    banned = _ok(shared_server, CHAT, {**body, "bad_words": ["Paris"]})["choices"][0]["message"]["content"]
    assert "Paris" not in banned and banned != plain


def test_skip_special_tokens_false_keeps_their_text(shared_server):  # noqa: F811
    body = {"prompt": "Hello", "temperature": 0, "max_tokens": 2, "logit_bias": {"1": 100}, "ignore_eos": True}
    assert "<|im_start|>" not in _ok(shared_server, COMPLETIONS, body)["choices"][0]["text"]
    kept = _ok(shared_server, COMPLETIONS, {**body, "skip_special_tokens": False})["choices"][0]["text"]
    assert kept == "<|im_start|><|im_start|>"


def _rendered(server, body: dict) -> str:
    reply = requests.post(f"{server.http_url}/tokenize", json={"model": MODEL, **body}, timeout=30).json()
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == 512, reply
    detok = requests.post(f"{server.http_url}/detokenize", json={"model": MODEL, "tokens": reply["tokens"]},
                          timeout=30).json()
    return detok["prompt"]


def test_chat_template_kwargs_reach_the_template(shared_server):  # noqa: F811
    template = "{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert _rendered(shared_server, {"messages": USER, "chat_template": template}) == USER[0]["content"]
    assert _rendered(shared_server, {"messages": USER, "chat_template": template,
                                     "chat_template_kwargs": {"shout": True}}) == "LOUD " + USER[0]["content"]


def test_reasoning_effort_is_a_template_variable(shared_server):  # noqa: F811
    template = "{{ reasoning_effort | default('unset') }}:{% for m in messages %}{{ m.content }}{% endfor %}"
    base = {"messages": USER, "chat_template": template}
    assert _rendered(shared_server, base) == "unset:" + USER[0]["content"]
    assert _rendered(shared_server, {**base, "reasoning_effort": "low"}) == "low:" + USER[0]["content"]
    both = {**base, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
    assert _rendered(shared_server, both) == "high:" + USER[0]["content"]  # the request's own kwargs win, as vLLM
    reply = requests.post(f"{shared_server.http_url}{CHAT}", json={"model": MODEL, **base, "reasoning_effort": "huge",
                                                                   "max_tokens": 2}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "reasoning_effort"


def test_continue_final_message_and_echo(shared_server):  # noqa: F811
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    extras = {"add_generation_prompt": False, "continue_final_message": True}
    assert _rendered(shared_server, {"messages": messages, **extras}).endswith("The capital of France is")
    plain = _ok(shared_server, CHAT, {"messages": messages, **extras, **GREEDY})["choices"][0]["message"]["content"]
    echoed = _ok(shared_server, CHAT, {"messages": messages, **extras, **GREEDY, "echo": True})
    assert echoed["choices"][0]["message"]["content"] == "The capital of France is" + plain


def test_version(shared_server):  # noqa: F811
    reply = requests.get(f"{shared_server.http_url}/version", timeout=30).json()
    assert reply == {"version": importlib.metadata.version("pagedserve")}
