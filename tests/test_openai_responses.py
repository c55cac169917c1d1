"""POST /v1/responses through the official `openai` client (`responses.create`, streamed events, `responses.stream`)
against the shared server: each answer equals the chat completion of the same conversation (the Responses API is
served by the chat path), streamed events add up to the final response in order, function tools go round a two-turn
loop, `text.format` constrains the output, and what needs a response store or a hosted tool is a 400 naming it.
Reasoning output items: tests/test_openai_reasoning.py."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests
from service_fixtures import shared_server  # noqa: F401 - fixture by name
from tool_templates import TEMPLATES

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
GREEDY = {"model": MODEL, "temperature": 0}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 24}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def client(shared_server):  # noqa: F811
    with openai.OpenAI(base_url=f"{shared_server.http_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def chat(client, messages: list[dict], **extra):
    return client.chat.completions.create(messages=messages, **GREEDY, **extra)


def test_a_response_is_the_chat_answer_to_the_same_conversation(client):
    response = client.responses.create(input=QUESTION, instructions="Answer briefly.", max_output_tokens=24, **GREEDY)
    reply = chat(client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}],
                 max_tokens=24)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == reply.choices[0].message.content
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.status == ("completed" if reply.choices[0].finish_reason == "stop" else "incomplete")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (reply.usage.prompt_tokens, reply.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.instructions == "Answer briefly." and response.max_output_tokens == 24


def test_a_cut_answer_is_incomplete_with_the_reason(client):
    response = client.responses.create(input=QUESTION, max_output_tokens=2, **GREEDY)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2


def test_streamed_events_are_in_order_and_add_up_to_the_response(client):
    whole = client.responses.create(input=QUESTION, max_output_tokens=24, **GREEDY)
    events = list(client.responses.create(input=QUESTION, max_output_tokens=24, stream=True, **GREEDY))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert final.output[0].id == events[2].item.id == events[-2].item.id
    with client.responses.stream(input=QUESTION, max_output_tokens=24, **GREEDY) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == whole.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_function_tools_go_round_a_two_turn_loop(client, stream):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(input=ask, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **GREEDY)
    if stream:
        events = list(client.responses.create(**kwargs, stream=True))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
        response = events[-1].response
    else:
        response = client.responses.create(**kwargs)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    back = [*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}]
    template = {"chat_template": TEMPLATES["hermes"]}  # renders calls and results (SmolLM2's own has no tool turns)
    answer = client.responses.create(input=back, tools=TOOLS, tool_choice="none", max_output_tokens=32,
                                     extra_body=template, **GREEDY)
    reply = chat(client, [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 C"}], tools=CHAT_TOOLS,
        tool_choice="none", max_tokens=32, extra_body=template)
    assert answer.output_text == reply.choices[0].message.content


def test_text_format_json_schema_constrains_the_text(client):
    text = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    response = client.responses.create(input=QUESTION + " Reply in JSON.", text=text, max_output_tokens=48, **GREEDY)
    jsonschema.validate(json.loads(response.output_text), ANSWER)
    assert response.text.format.type == "json_schema"


def test_input_items_with_parts_and_roles_render_as_chat_messages(client):
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": QUESTION}]
    response = client.responses.create(input=items, max_output_tokens=16, **GREEDY)
    reply = chat(client, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": QUESTION}],
                 max_tokens=16)
    assert response.output_text == reply.choices[0].message.content


ERRORS = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"instructions": 3}, "instructions"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "required"}, "tools[0].name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nonsense"}}}}, "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**7}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"truncation": "middle"}, "truncation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"reasoning": "high"}, "reasoning"),
    ({"n": 2, "temperature": 0.5}, "n"),  # chat fields pass on: a response has one answer
]


@pytest.mark.parametrize(("fields", "param"), ERRORS, ids=[e[1] for e in ERRORS])
def test_bad_requests_are_400_naming_the_responses_field(shared_server, fields, param):  # noqa: F811
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, **fields}
    reply = requests.post(f"{shared_server.http_url}/v1/responses", json=body, timeout=120)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_items_of_one_turn_become_one_assistant_message_and_a_thought_joins_its_turn():
    from pagedserve.service.openai.responses_request import chat_body

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    body, names = chat_body({"instructions": "sys", "input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"role": "assistant", "content": "Let me look."}, call, {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}]}]})
    user, assistant, tool = body["messages"][1:]
    assert body["messages"][0] == {"role": "system", "content": "sys"} and user["content"] == "q"
    assert assistant["reasoning"] == "hmm" and assistant["content"] == "Let me look."
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    assert names("messages[2].tool_calls[1]") == "input[2].tool_calls[1]" and names("messages[0]") == "instructions"
    assert names("response_format.json_schema.schema") == "text.format.schema"
    assert names("tools[3].function.parameters") == "tools[3].parameters" and names("max_tokens") == "max_output_tokens"


def test_fields_this_server_does_not_use_are_ignored(shared_server):  # noqa: F811
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 2, "include": ["reasoning.encrypted_content"],
            "max_tool_calls": 3, "stream_options": {"include_obfuscation": False}, "store": True}
    reply = requests.post(f"{shared_server.http_url}/v1/responses", json=body, timeout=120)
    assert reply.status_code == 200 and reply.json()["store"] is False, reply.text  # nothing is stored
