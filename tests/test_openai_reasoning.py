"""`--reasoning-parser` through a real server and the official `openai` client: chat answers carry the model's
thought as `reasoning` apart from `content` (streamed as `reasoning` deltas), a structured output or a forced tool call
starts once the thought has closed, a prompt that closed the thought answers everything as content, and the router
protocol tells SMG where constraints start.

The model is the real default one (SmolLM2-135M-Instruct), shown three answers that think in `<think>...</think>`
first; what each answer must be is read from the same server's raw completion of the same prompt tokens."""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest
import requests
from service_fixtures import engine_idle, start_server, wait_until
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc

from pagedserve.client import Client, ClientError, Message
from pagedserve.engine.reasoning import REASONING_FORMATS

MODEL = "SmolLM2-135M-Instruct"
SHOTS = (("What is 2+2?", "<think>2 plus 2 makes 4.</think>The answer is 4."),
         ("What color is the sky?", "<think>The sky looks blue in daylight.</think>The sky is blue."),
         ("What is the capital of Italy?", "<think>Italy's capital city is Rome.</think>The capital of Italy is Rome."))
QUESTIONS = ("What is the capital of France?", "Name a fruit that is yellow.")
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 24}}, "required": ["answer"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a fact up", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 24}}, "required": ["query"],
    "additionalProperties": False}}}]
# ChatML as SmolLM2 writes it, plus what reasoning models' templates do: an earlier turn's thought rendered from the
# message's reasoning, and an empty closed thought in the prompt when thinking is off (Qwen3's enable_thinking).
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
            "</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def messages(question: str) -> list[dict]:
    out = [{"role": "system", "content": "Think inside <think></think> first, then answer."}]
    for user, answer in SHOTS:
        out += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return [*out, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("reasoning"), "--http-port", "0", "--max-model-len", "1024",
                          "--kv-cache-memory", "64MiB", "--reasoning-parser", "deepseek_r1",
                          "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield server
    with grpc.insecure_channel(server.target) as channel:
        wait_until(lambda: engine_idle(channel), 30, "no request or KV block left behind")
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def raw_text(server, body: dict) -> str:
    """The model's own text for the prompt a chat request renders: /tokenize, then /v1/completions of those ids."""
    ids = requests.post(f"{server.http_url}/tokenize", json={"model": MODEL, **body}, timeout=60).json()["tokens"]
    reply = requests.post(f"{server.http_url}/v1/completions", json={
        "model": MODEL, "prompt": ids, "max_tokens": 64, "temperature": 0}, timeout=300)
    return reply.json()["choices"][0]["text"]


def chat(client, question: str, **extra):
    return client.chat.completions.create(model=MODEL, messages=messages(question), max_tokens=64, temperature=0,
                                          **extra).choices[0]


def streamed(client, question: str, **extra) -> tuple[str, str, list]:
    thought, content, deltas = "", "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages(question), max_tokens=64,
                                                temperature=0, stream=True, **extra):
        delta = chunk.choices[0].delta
        deltas.append(delta)
        thought += getattr(delta, "reasoning", None) or ""
        content += delta.content or ""
    return thought, content, deltas


@pytest.mark.parametrize("question", QUESTIONS)
def test_the_thought_is_reasoning_and_the_rest_content(server, client, question):
    raw = raw_text(server, {"messages": messages(question)})
    assert raw.startswith("<think>") and "</think>" in raw  # the model thinks, then answers
    thought, _, answer = raw.removeprefix("<think>").partition("</think>")
    message = chat(client, question).message
    assert (message.reasoning, message.content) == (thought, answer)


@pytest.mark.parametrize("question", QUESTIONS)
def test_streams_add_up_to_the_whole_answer_and_never_show_a_marker(client, question):
    whole = chat(client, question).message
    thought, content, deltas = streamed(client, question)
    assert (thought, content) == (whole.reasoning, whole.content)
    assert deltas[0].role == "assistant"
    assert not any("think>" in ((getattr(d, "reasoning", None) or "") + (d.content or "")) for d in deltas)


def test_include_reasoning_false_leaves_the_thought_out(client):
    whole = chat(client, QUESTIONS[0]).message
    without = chat(client, QUESTIONS[0], extra_body={"include_reasoning": False}).message
    assert without.reasoning is None and without.content == whole.content
    thought, content, _ = streamed(client, QUESTIONS[0], extra_body={"include_reasoning": False})
    assert (thought, content) == ("", whole.content)


@pytest.mark.parametrize("question", QUESTIONS)
def test_a_json_schema_applies_once_the_thought_closed(client, question):
    free = chat(client, question).message
    format_ = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    held = chat(client, question, response_format=format_)
    assert held.message.reasoning == free.reasoning  # the model's own thought, unmasked
    jsonschema.validate(json.loads(held.message.content), ANSWER)
    thought, content, _ = streamed(client, question, response_format=format_)
    assert (thought, content) == (held.message.reasoning, held.message.content)


def test_a_forced_tool_call_follows_the_thought(client):
    free = chat(client, QUESTIONS[0]).message
    forced = chat(client, QUESTIONS[0], tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert forced.finish_reason == "tool_calls" and forced.message.reasoning == free.reasoning
    (call,) = forced.message.tool_calls
    assert call.function.name == "lookup"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])


def test_a_thinking_budget_cuts_the_thought_short_and_the_model_answers(client):
    free = chat(client, QUESTIONS[1]).message
    capped = chat(client, QUESTIONS[1], extra_body={"thinking_token_budget": 3}).message
    assert free.reasoning.startswith(capped.reasoning) and 0 < len(capped.reasoning) < len(free.reasoning)
    assert capped.content and "</think>" not in capped.reasoning
    thought, content, _ = streamed(client, QUESTIONS[1], extra_body={"thinking_token_budget": 3})
    assert (thought, content) == (capped.reasoning, capped.content)


def test_a_prompt_that_closed_the_thought_answers_all_content(server, client):
    off = {"chat_template": TEMPLATE, "chat_template_kwargs": {"enable_thinking": False}}
    body = {"messages": messages(QUESTIONS[0]), **off}
    raw = raw_text(server, body)
    message = chat(client, QUESTIONS[0], extra_body=off).message
    assert message.reasoning is None and message.content == raw
    format_ = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    held = chat(client, QUESTIONS[0], extra_body=off, response_format=format_).message
    assert held.reasoning is None
    jsonschema.validate(json.loads(held.content), ANSWER)  # constrained from the first token


def test_an_earlier_turns_thought_sent_back_reaches_the_template(server):
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning": "Be nice."},
             {"role": "user", "content": "Bye"}]
    tokens = requests.post(f"{server.http_url}/tokenize", json={
        "model": MODEL, "messages": turns, "chat_template": TEMPLATE}, timeout=60).json()["tokens"]
    text = requests.post(f"{server.http_url}/detokenize", json={"model": MODEL, "tokens": tokens},
                         timeout=60).json()["prompt"]
    assert "assistant\n<think>Be nice.</think>Hello!\n" in text  # /detokenize leaves the special tokens out
    turns[1] = {**turns[1], "reasoning": None, "reasoning_content": "Be nice."}  # the older name
    assert requests.post(f"{server.http_url}/tokenize", json={
        "model": MODEL, "messages": turns, "chat_template": TEMPLATE}, timeout=60).json()["tokens"] == tokens


def test_completions_are_not_split(server):
    reply = requests.post(f"{server.http_url}/v1/completions", json={
        "model": MODEL, "prompt": "<think>Hi</think>", "max_tokens": 4, "temperature": 0}, timeout=300).json()
    assert "reasoning" not in reply["choices"][0]


def test_the_router_learns_the_parser_and_that_constraints_wait_for_the_thought(server):
    with grpc.insecure_channel(server.target) as channel:
        info = vgrpc.VllmEngineStub(channel).GetServerInfo(vpb.GetServerInfoRequest(), timeout=30)
    assert (info.engine_reasoning_parser, info.constrained_decoding_start) == ("deepseek_r1", "after_reasoning")


def _router_text(server, text: str, **fields) -> str:
    request = vpb.GenerateRequest(request_id="reasoning", text=text, sampling_params=vpb.SamplingParams(
        temperature=0, max_tokens=64, json_schema=json.dumps(ANSWER), **fields))
    with grpc.insecure_channel(server.target) as channel:
        replies = list(vgrpc.VllmEngineStub(channel).Generate(request, timeout=300))
    (complete,) = [r.complete for r in replies if r.WhichOneof("response") == "complete"]
    return requests.post(f"{server.http_url}/detokenize", json={"model": MODEL, "tokens": list(complete.output_ids)},
                         timeout=60).json()["prompt"]


def test_router_constraints_wait_for_the_thought_unless_the_gateway_says_it_leads_with_it(server):
    ids = requests.post(f"{server.http_url}/tokenize", json={"model": MODEL, "messages": messages(QUESTIONS[0])},
                        timeout=60).json()["tokens"]
    text = requests.post(f"{server.http_url}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=60).json()
    opened = text["prompt"] + "<think>\n"  # a prompt that leaves the thought open, as DeepSeek-R1's template does
    thought, marker, answer = _router_text(server, opened).partition("</think>")
    assert marker and thought.strip()  # the model thought freely, then the grammar applied
    jsonschema.validate(json.loads(answer), ANSWER)
    jsonschema.validate(json.loads(_router_text(server, opened, grammar_from_first_token=True)), ANSWER)


def test_bad_include_reasoning_is_a_400_naming_it(server):
    reply = requests.post(f"{server.http_url}/v1/chat/completions", json={
        "model": MODEL, "messages": messages(QUESTIONS[0]), "include_reasoning": "yes"}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "include_reasoning"


def test_the_known_formats():
    assert REASONING_FORMATS.names() == ["deepseek_r1", "qwen3"]


def test_responses_carry_the_thought_as_a_reasoning_item(client):
    whole = chat(client, QUESTIONS[0]).message
    kwargs = dict(model=MODEL, input=messages(QUESTIONS[0]), max_output_tokens=64, temperature=0)
    response = client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == whole.reasoning and response.output_text == whole.content
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    events = list(client.responses.create(**kwargs, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == whole.reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.content
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == whole.content
    assert final.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens_details.reasoning_tokens


def test_pagedserve_v1_chat_answers_carry_the_thought_apart(server, client):
    """The same split over pagedserve.v1 (Delta.reasoning, the Python client's Completion.reasoning): streamed and
    final-only, with a budget; text prompts are not split; a thought goes back on an assistant turn only."""
    whole = chat(client, QUESTIONS[0]).message
    turns = [Message(m["role"], m["content"]) for m in messages(QUESTIONS[0])]
    with Client(server.target, timeout=300) as v1:
        got = v1.complete(turns, temperature=0, max_new_tokens=64)
        assert (got.reasoning, got.text) == (whole.reasoning, whole.content)
        once = v1.complete(turns, temperature=0, max_new_tokens=64, final_only=True)
        assert (once.reasoning, once.text) == (got.reasoning, got.text)
        capped = v1.complete(turns, temperature=0, max_new_tokens=64, thinking_token_budget=3)
        assert whole.reasoning.startswith(capped.reasoning) and 0 < len(capped.reasoning) < len(whole.reasoning)
        plain = v1.complete("<think>Hi</think>", temperature=0, max_new_tokens=4)
        assert plain.reasoning == ""
        back = [*turns, Message("assistant", whole.content, reasoning=whole.reasoning), Message("user", "Thanks!")]
        assert v1.complete(back, temperature=0, max_new_tokens=4).final is not None
        with pytest.raises(ClientError) as info:
            v1.complete([Message("user", "Hi", reasoning="no")], max_new_tokens=2)
        assert info.value.field == "chat.messages[0].reasoning"


def test_responses_a_thought_then_a_forced_call_are_two_items(client):
    tools = [{"type": "function", **{k: v for k, v in TOOLS[0]["function"].items()}}]
    kwargs = dict(model=MODEL, input=messages(QUESTIONS[0]), tools=tools, tool_choice="required",
                  parallel_tool_calls=False, temperature=0, max_output_tokens=64)
    whole = client.responses.create(**kwargs)
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    jsonschema.validate(json.loads(whole.output[1].arguments), TOOLS[0]["function"]["parameters"])
    events = list(client.responses.create(**kwargs, stream=True))
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[1].arguments == whole.output[1].arguments
    assert final.output[0].content[0].text == whole.output[0].content[0].text
