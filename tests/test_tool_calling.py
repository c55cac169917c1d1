"""A two-turn agent loop through the official `openai` client, against real servers started with
`--enable-auto-tool-choice --tool-call-parser NAME` and a chat template that renders tools, calls and tool results
in that family's format (tool_templates.py), once per parser, streamed and not:

1. `tool_choice: "required"`: the grammar forces one call in the parser's own format; the client gets `tool_calls`
   (the streamed deltas add up to the same call).
2. The call and a `tool` result go back with `tools` and no `tool_choice` (auto): the prompt the server renders is
   byte for byte transformers' rendering of the same conversation (/tokenize), and the answer is exactly what the
   parser reads from the model's own greedy text for that prompt (the same request with tool_choice "none").
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests
from service_fixtures import start_server
from tool_templates import TEMPLATES
from transformers import AutoTokenizer

from pagedserve.engine.loading.model_store import resolve_model
from pagedserve.service.openai.tool_parsers.registry import TOOL_PARSERS

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
             "additionalProperties": False}}}]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
SETTINGS = {"model": MODEL, "temperature": 0, "max_tokens": 64}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def served(request, tmp_path_factory):
    parser = request.param
    workdir = tmp_path_factory.mktemp(f"tools-{parser}")
    template = workdir / "template.jinja"
    template.write_text(TEMPLATES[parser])
    server = start_server(workdir, "--http-port", "0", "--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                          "--chat-template", str(template), "--enable-auto-tool-choice", "--tool-call-parser", parser)
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=300)
    yield parser, server, client
    server.stop()


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(None).tokenizer_dir)


def _streamed(client: openai.OpenAI, **kwargs) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """(content, [(id, name, arguments)], finish_reason) accumulated from the deltas as SDK users do."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in calls and call.type == "function" and call.function.name
                calls[call.index] = [call.id, call.function.name, ""]
            calls[call.index][2] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


def _first_turn(client: openai.OpenAI, stream: bool) -> dict:
    kwargs = dict(SETTINGS, messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    if stream:
        content, calls, finish = _streamed(client, **kwargs)
        assert finish == "tool_calls" and not content.strip()
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    (call_id, name, arguments), = calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
    jsonschema.validate(json.loads(arguments), schema)
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_two_turn_tool_loop(served, hf_tokenizer, stream):
    parser, server, client = served
    call = _first_turn(client, stream)
    result = {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "name": call["tool_calls"][0]["function"][
        "name"], "content": "18 degrees Celsius, light rain"}
    messages = [*QUESTION, call, result]

    # The server renders tools, the call and the result as transformers does (arguments as an object, as vLLM
    # hands them to templates).
    reference = json.loads(json.dumps(messages))
    reference[1]["tool_calls"][0]["function"]["arguments"] = json.loads(call["tool_calls"][0]["function"]["arguments"])
    expected_ids = hf_tokenizer.apply_chat_template(reference, tools=TOOLS, chat_template=TEMPLATES[parser],
                                                    add_generation_prompt=True, tokenize=True, return_dict=False)
    tokenized = requests.post(f"{server.http_url}/tokenize", json={
        "model": MODEL, "messages": messages, "tools": TOOLS},
        timeout=60).json()
    assert tokenized["tokens"] == list(expected_ids)
    assert "18 degrees Celsius" in hf_tokenizer.decode(tokenized["tokens"])

    second = dict(SETTINGS, messages=messages, tools=TOOLS)
    raw = client.chat.completions.create(**second, tool_choice="none", extra_body=_same_text(parser)).choices[0]
    assert raw.message.tool_calls in (None, [])
    want_content, want_calls = _read(parser, raw.message.content)
    if stream:
        content, calls, finish = _streamed(client, **second)
        got_calls = [(name, arguments) for _, name, arguments in calls]
        assert content == (want_content or "") or (not content.strip() and want_content is None)
    else:
        reply = client.chat.completions.create(**second)
        choice, finish = reply.choices[0], reply.choices[0].finish_reason
        got_calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert choice.message.content == want_content
        assert reply.usage.prompt_tokens == len(expected_ids)
    assert got_calls == want_calls
    assert finish == ("tool_calls" if want_calls and raw.finish_reason == "stop" else raw.finish_reason)


def _same_text(parser: str) -> dict:
    """The plain request decodes as the parser's requests do (mistral keeps special tokens)."""
    return {"skip_special_tokens": not TOOL_PARSERS.get(parser).keeps_special_tokens}


def _read(parser: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    from pagedserve.service.openai.tool_parsers.stream import ToolCallStream

    content, calls = ToolCallStream(TOOL_PARSERS.get(parser)()).message(text)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_plain_answers_pass_through_auto_unchanged(served):
    """A question no tool answers: the auto reply is the model's text as "none" gives it, when it holds no call."""
    parser, _, client = served
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    plain = client.chat.completions.create(**SETTINGS, messages=messages, tools=TOOLS, tool_choice="none",
                                           extra_body=_same_text(parser))
    auto = client.chat.completions.create(**SETTINGS, messages=messages, tools=TOOLS, tool_choice="auto")
    content, calls = _read(parser, plain.choices[0].message.content)
    assert auto.choices[0].message.content == content
    assert [(c.function.name, c.function.arguments) for c in auto.choices[0].message.tool_calls or []] == calls


def test_a_schema_the_grammar_refuses_is_a_400_and_the_server_keeps_serving(served):
    parser, _, client = served
    broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**SETTINGS, messages=QUESTION, tools=broken, tool_choice="required")
    named = ("pythonic", "qwen3_coder")  # formats of named parameters check the schema's shape themselves
    assert refused.value.param == ("tools[0].function.parameters" if parser in named else "tools")
    assert client.chat.completions.create(**SETTINGS, messages=QUESTION).choices[0].finish_reason in ("stop", "length")
