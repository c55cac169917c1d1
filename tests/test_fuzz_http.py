"""Property-based fuzzing of the OpenAI HTTP front end over a real socket: completions, chat and responses bodies whose
parameters are legal, out of range or of the wrong JSON type, sent beside a well-formed gRPC bystander in the same
batch; and raw garbage bodies on every POST route.

Each example checks: the status is one OpenAI documents for these routes (200, 400, 404, 413, 429; never 5xx);
a 400 for a JSON object names the parameter (`error.param`, whose top level is a key of the body); a 200 carries
n choices (streams end with `data: [DONE]`); the bystander's tokens equal its solo run; afterwards no request runs,
no KV block is held and both protocols still serve. Budget and replay: see fuzz_support.py.
"""

from __future__ import annotations

import concurrent.futures
import json

import grpc
import pytest
from constraint_strategies import CHOICES, GRAMMARS, REGEXES, SCHEMAS, STRUCTURAL_TAGS
from fuzz_support import (
    ANY_JSON, check_http_status, fuzz_settings, garbage_never_breaks_the_route, plausible, post, run_beside_a_bystander,
)
from hypothesis import given
from hypothesis import strategies as st
from service_fixtures import engine_idle, shared_server, stub, wait_until  # noqa: F401

from pagedserve.v1 import generate_pb2 as pb

COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
MODEL = "SmolLM2-135M-Instruct"
NUMBER = st.one_of(st.floats(-3, 3), st.floats(allow_nan=False, allow_infinity=False))
SHARED_PARAMS = {
    "temperature": st.one_of(plausible(0, 0.0, 0.7, 1e-45, -1, 3), NUMBER),
    "top_p": st.one_of(plausible(0.0, 0.5, 1, 1.5), NUMBER),
    "top_k": plausible(-1, 0, 1, 40, 2**40),
    "min_p": plausible(0.0, 0.1, 1.0, -0.1),
    "max_tokens": plausible(None, 0, 1, 3, 10**9),
    "max_completion_tokens": plausible(None, 1, 3, -1),
    "stop": plausible(None, "\n", ["a", "b"], [], ["x"] * 5, "y" * 300),
    "seed": plausible(None, 0, 42, -1, 2**64),
    "n": plausible(1, 2, 0, 129),
    "presence_penalty": plausible(0.0, 1.5, -2.0, 3.0),
    "frequency_penalty": plausible(0.0, 1.5, -2.5),
    "repetition_penalty": plausible(1.0, 1e-45, 0.5, 101),
    "logit_bias": plausible({}, {"42": 5}, {"42": 101}, {"-1": 1}, {"99999999": 1}, {"x": 1}),
    "ignore_eos": plausible(True, False),
    "stream": plausible(True, False),
    "stream_options": plausible(None, {"include_usage": True}, {"include_usage": "yes"}),
    "user": plausible("u1"),
    "model": st.sampled_from([MODEL, MODEL, MODEL, "no-such-model", 7]),
    "unknown_field_x": ANY_JSON,
    # vLLM's extras
    "truncate_prompt_tokens": plausible(None, -1, 0, 1, 4, -2, 10**9),
    "allowed_token_ids": plausible(None, [], [42, 43], [-1], [99999999], [True]),
    "bad_words": plausible(None, [], ["Paris"], [""], [" "], ["a"] * 300, [1]),
    "skip_special_tokens": plausible(True, False),
    "include_stop_str_in_output": plausible(True, False),
    "priority": plausible(0, 1, -1),
    "prompt_logprobs": plausible(None, 0, 1),
}
COMPLETION_PARAMS = {
    **SHARED_PARAMS,
    "prompt": plausible("Hello", "", ["a", "b"], [1, 2, 3], [[1, 2], [3]], [], [-1], "word " * 9000),
    "logprobs": plausible(None, 0, 2, 5, 6, -1),
    "echo": plausible(False, True),
    "suffix": plausible(None, "x"),
    "best_of": plausible(None, 1, 2),
}
TOOLS = st.lists(st.builds(lambda name, schema: {"type": "function", "function": {"name": name, "parameters": schema}},
                          st.sampled_from(["f0", "f1", "f2"]), SCHEMAS), min_size=1, max_size=3)
TOOL_CALL = st.fixed_dictionaries({"id": plausible("call_1", "abcdefghi"), "type": plausible("function"),
                                   "function": plausible({"name": "f0", "arguments": "{}"},
                                                         {"name": "f1", "arguments": "{oops"}, {"name": 3})})
MESSAGE = st.fixed_dictionaries(
    {"role": plausible("user", "system", "assistant", "wizard", "tool"),
     "content": plausible("Hi", "", None, [{"type": "text", "text": "Hi"}], [{"type": "image_url"}])},
    optional={"tool_calls": st.one_of(st.lists(TOOL_CALL, max_size=2), ANY_JSON),
              "tool_call_id": plausible("call_1", 5), "name": plausible("f0", None, [1])})
CHAT_PARAMS = {
    **SHARED_PARAMS,
    "messages": st.one_of(st.lists(MESSAGE, max_size=4), ANY_JSON),
    "logprobs": plausible(None, False, True),
    "top_logprobs": plausible(None, 0, 3, 21),
    "tools": st.one_of(plausible(None, [], [{"type": "function"}]), TOOLS),
    "tool_choice": plausible("none", "auto", "required", {"type": "function", "function": {"name": "f0"}},
                             {"type": "function", "function": {"name": "nope"}}),
    "parallel_tool_calls": plausible(True, False),
    "chat_template_kwargs": plausible(None, {}, {"enable_thinking": False}, {"messages": 1}, [1]),
    "add_generation_prompt": plausible(True, False),
    "continue_final_message": plausible(True, False),
    "echo": plausible(False, True),
    "documents": plausible(None, [{"title": "t", "text": "x"}], ["x"]),
}
# Structured outputs, every dialect, on both endpoints: generated schemas, regexes, choices and grammars.
CONSTRAINT_PARAMS = {
    "response_format": st.one_of(
        plausible(None, {"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}),
        st.builds(lambda schema, strict: {"type": "json_schema", "json_schema": {
            "name": "out", "schema": schema, "strict": strict}}, SCHEMAS, st.booleans()),
        STRUCTURAL_TAGS.map(lambda tag: {"type": "structural_tag", **tag})),
    "structured_outputs": st.one_of(
        st.fixed_dictionaries({"json": SCHEMAS}), st.fixed_dictionaries({"regex": REGEXES}),
        st.fixed_dictionaries({"choice": CHOICES}), st.fixed_dictionaries({"grammar": GRAMMARS}),
        st.just({"json_object": True}), ANY_JSON),
    "guided_json": st.one_of(SCHEMAS, ANY_JSON),
    "guided_regex": st.one_of(REGEXES, ANY_JSON),
    "guided_choice": st.one_of(CHOICES, ANY_JSON),
    "guided_grammar": GRAMMARS,
}
COMPLETION_PARAMS.update(CONSTRAINT_PARAMS)
CHAT_PARAMS.update(CONSTRAINT_PARAMS)
ITEM = st.one_of(
    MESSAGE, st.fixed_dictionaries({"type": st.just("message"), "role": plausible("user", "developer", "assistant"),
                                    "content": plausible([{"type": "input_text", "text": "Hi"}],
                                                          [{"type": "output_text", "text": "Yo"}],
                                                          [{"type": "input_image", "image_url": "x"}])}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": plausible("c1"), "name": plausible("f0"),
                           "arguments": plausible("{}", "{oops", 5)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": plausible("c1"),
                           "output": plausible("ok", [{"type": "input_text", "text": "ok"}], 3)}),
    st.fixed_dictionaries({"type": plausible("reasoning", "item_reference", "web_search_call"),
                           "content": plausible([{"type": "reasoning_text", "text": "hm"}], "x")}))
RESPONSES_PARAMS = {
    **{name: SHARED_PARAMS[name] for name in ("temperature", "top_p", "top_k", "seed", "stop", "stream", "model",
                                              "unknown_field_x", "priority", "user")},
    "input": st.one_of(plausible("Hi", ""), st.lists(ITEM, max_size=4), ANY_JSON),
    "instructions": plausible(None, "Be brief.", 3),
    "max_output_tokens": plausible(None, 0, 1, 3, 10**9),
    "tools": st.one_of(plausible(None, [], [{"type": "web_search"}], [{"type": "function", "name": "f0"}]),
                       TOOLS.map(lambda tools: [{"type": "function", **t["function"]} for t in tools])),
    "tool_choice": plausible("none", "auto", "required", {"type": "function", "name": "f0"}, {"type": "mcp"}),
    "text": st.one_of(plausible(None, {"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                                {"format": {"type": "json_schema"}}, {"format": "x"}),
                      SCHEMAS.map(lambda schema: {"format": {"type": "json_schema", "name": "o", "schema": schema}})),
    "reasoning": plausible(None, {"effort": "low"}, "high"),
    "truncation": plausible("auto", "disabled", "middle"),
    "previous_response_id": plausible(None, "resp_1"),
    "store": plausible(True, False),
    "parallel_tool_calls": plausible(True, False),
    "metadata": plausible(None, {"k": "v"}),
    "top_logprobs": plausible(None, 0, 2),
}


@st.composite
def bodies(draw) -> tuple[str, dict]:
    path = draw(st.sampled_from([COMPLETIONS, CHAT, RESPONSES]))
    params = {COMPLETIONS: COMPLETION_PARAMS, CHAT: CHAT_PARAMS, RESPONSES: RESPONSES_PARAMS}[path]
    # cheap unless a draw overrides it
    body = {"model": MODEL, "max_output_tokens" if path == RESPONSES else "max_tokens": 3}
    for name in draw(st.lists(st.sampled_from(sorted(params)), max_size=6, unique=True)):
        body[name] = draw(params[name])
    if path == COMPLETIONS:
        body.setdefault("prompt", "Hello")
    elif path == CHAT:
        body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    else:
        body.setdefault("input", "Hi")
    return path, body


BYSTANDER = pb.GenerateRequest(text="Name three colours:", sampling=pb.SamplingOptions(temperature=0),
                               stopping=pb.StoppingOptions(max_new_tokens=10, ignore_eos=True))


def check_reply(body: dict, status: int, payload: bytes, responses: bool = False) -> None:
    check_http_status(body, status, payload)
    if status != 200:
        return
    if responses:
        _check_response(body, payload)
        return
    if body.get("stream") is True:
        text = payload.decode()
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        indexes = {c["index"] for e in events for c in e.get("choices", [])}
        assert indexes == set(range(_expected_choices(body))), (indexes, body)
    else:
        reply = json.loads(payload)
        assert len(reply["choices"]) == _expected_choices(body), (reply, body)


def _check_response(body: dict, payload: bytes) -> None:
    """A Responses API answer: the object, or typed events numbered in order ending with the whole object."""
    if body.get("stream") is True:
        text = payload.decode()
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
        assert [e["sequence_number"] for e in events] == list(range(len(events))) and "[DONE]" not in text
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        reply = events[-1]["response"]
    else:
        reply = json.loads(payload)
    assert reply["object"] == "response" and reply["status"] in ("completed", "incomplete"), reply


def _expected_choices(body: dict) -> int:
    n = body.get("n", 1)
    n = 1 if n is None else n
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return n * prompts


@pytest.fixture(scope="module")
def channel(shared_server) -> grpc.Channel:  # noqa: F811
    with grpc.insecure_channel(shared_server.target) as ch:
        yield ch


def _tokens(channel: grpc.Channel) -> list[int]:
    return [t for frame in stub(channel).Generate(BYSTANDER, timeout=300) for t in frame.delta.token_ids]


def test_fuzzed_openai_bodies_never_harm_a_bystander(shared_server, channel):  # noqa: F811
    alone = _tokens(channel)
    pool = concurrent.futures.ThreadPoolExecutor(4)

    @fuzz_settings()
    @given(st.lists(bodies(), min_size=1, max_size=3))
    def run(requests: list[tuple[str, dict]]) -> None:
        bystander = pool.submit(_tokens, channel)
        replies = list(pool.map(lambda r: post(shared_server.http_port, r[0], json.dumps(r[1]).encode()), requests))
        for (path, body), (status, payload) in zip(requests, replies):
            check_reply(body, status, payload, responses=path == RESPONSES)
        assert bystander.result() == alone
        wait_until(lambda: engine_idle(channel), 60, "every fuzzed request to leave the engine")

    run_beside_a_bystander(run, pool, channel)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, RESPONSES, "/v1/models", "/health", "/v1/nothing"])
def test_raw_garbage_bodies(shared_server, channel, path):  # noqa: F811
    probe = (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})
    garbage_never_breaks_the_route(shared_server.http_port, path, channel, probe)
