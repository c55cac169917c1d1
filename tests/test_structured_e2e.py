"""Structured outputs end to end on the shared server, one real request per surface and kind: pagedserve.v1 through
the Python client, the OpenAI API through the official `openai` client (every dialect, and forced tool calls
streamed and not), and the router protocol. Greedy outputs are checked against independent references: the
`jsonschema` package for schemas, `re.fullmatch` for regexes, membership for choices; afterwards no KV block is
held."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest
from service_fixtures import engine_idle, server_factory, shared_server, wait_until  # noqa: F401 - fixtures by name
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc
from transformers import AutoTokenizer

from pagedserve.client import Choice, Client, FinishReason, Grammar, JsonObject, JsonSchema, Message, Regex

MODEL = "SmolLM2-135M-Instruct"
SCHEMAS = json.loads((Path(__file__).parent / "fixtures" / "service_schemas.json").read_text())
SCHEMA_NAMES = ("person", "sentiment", "nested_order")
PHONE = r"[0-9]{3}-[0-9]{4}"
ANSWERS = ["yes", "no", "maybe"]
GRAMMAR = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
QUESTION = "Give me a JSON object describing a person, with a phone number."
SHORT_OBJECT = "Is Paris in France? Answer as a JSON object."  # the model closes any object it starts for this
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"],
        "additionalProperties": False}}},
]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def validates(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


@pytest.fixture(scope="module")
def oai(shared_server) -> openai.OpenAI:  # noqa: F811
    with openai.OpenAI(base_url=f"{shared_server.http_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def py_client(shared_server) -> Client:  # noqa: F811
    with Client(shared_server.target, timeout=300) as client:
        yield client


@pytest.fixture(scope="module", autouse=True)
def no_leak(shared_server):  # noqa: F811
    yield
    with grpc.insecure_channel(shared_server.target) as channel:
        wait_until(lambda: engine_idle(channel), 30, "no request or KV block left behind")


# --- pagedserve.v1 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_v1_json_schema(py_client, name):
    got = py_client.complete([Message("user", QUESTION)], temperature=0, max_new_tokens=160,
                             constraint=JsonSchema(SCHEMAS[name]))
    assert got.finish_reason is FinishReason.EOS_TOKEN, got
    validates(got.text, SCHEMAS[name])


def test_v1_regex_choice_grammar_and_json_object(py_client):
    greedy = dict(temperature=0, max_new_tokens=64)
    assert re.fullmatch(PHONE, py_client.complete("My phone number is", **greedy, constraint=Regex(PHONE)).text)
    assert py_client.complete("Is Paris in France?", **greedy, constraint=Choice(ANSWERS)).text in ANSWERS
    text = py_client.complete("Is Paris in France?", **greedy, constraint=Grammar(GRAMMAR)).text
    assert re.fullmatch(r"The answer is (yes|no)\.", text), text
    got = py_client.complete([Message("user", SHORT_OBJECT)], temperature=0, max_new_tokens=120,
                             constraint=JsonObject())
    assert got.finish_reason is FinishReason.EOS_TOKEN and isinstance(json.loads(got.text), dict), got


def test_v1_sampled_outputs_validate(py_client):
    schema = SCHEMAS["sentiment"]
    for temperature, seed in ((0.7, 1), (1.0, 2), (1.5, 3), (1.5, 4)):
        got = py_client.complete([Message("user", "Rate this review: great food!")], temperature=temperature,
                                 seed=seed, max_new_tokens=96, constraint=JsonSchema(schema))
        assert got.finish_reason is FinishReason.EOS_TOKEN, got
        validates(got.text, schema)


# --- OpenAI HTTP -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_openai_response_format_json_schema(oai, name):
    answer = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=160,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                                "strict": True}})
    assert answer.choices[0].finish_reason == "stop"
    validates(answer.choices[0].message.content, SCHEMAS[name])


def test_openai_every_dialect(oai):
    greedy = dict(model=MODEL, temperature=0, max_tokens=64)
    chat = [{"role": "user", "content": QUESTION}]
    cases = [
        ({"structured_outputs": {"regex": PHONE}}, lambda t: re.fullmatch(PHONE, t)),
        ({"guided_regex": PHONE}, lambda t: re.fullmatch(PHONE, t)),
        ({"structured_outputs": {"choice": ANSWERS}}, lambda t: t in ANSWERS),
        ({"guided_choice": ANSWERS}, lambda t: t in ANSWERS),
        ({"structured_outputs": {"grammar": GRAMMAR}}, lambda t: re.fullmatch(r"The answer is (yes|no)\.", t)),
        ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(r"The answer is (yes|no)\.", t)),
        ({"guided_json": SCHEMAS["sentiment"]}, lambda t: validates(t, SCHEMAS["sentiment"]) or True),
        ({"structured_outputs": {"json": SCHEMAS["flag"]}}, lambda t: validates(t, SCHEMAS["flag"]) or True),
    ]
    for extra, check in cases:
        text = oai.completions.create(prompt="Is Paris in France?", extra_body=extra, **greedy).choices[0].text
        assert check(text), (extra, text)
        reply = oai.chat.completions.create(messages=chat, extra_body=extra, **greedy).choices[0]
        assert check(reply.message.content), (extra, reply)
    reply = oai.chat.completions.create(messages=[{"role": "user", "content": SHORT_OBJECT}],
                                        response_format={"type": "json_object"}, **{**greedy, "max_tokens": 120}
                                        ).choices[0]
    assert reply.finish_reason == "stop" and isinstance(json.loads(reply.message.content), dict), reply


def test_openai_streamed_json_schema_concatenates_to_the_whole(oai):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=160,
                  response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"]}})
    whole = oai.chat.completions.create(**kwargs).choices[0].message.content
    chunks = [c for c in oai.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    validates(whole, SCHEMAS["person"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_openai_forced_tool_call(oai, tool_choice):
    answer = oai.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice=tool_choice,
                                         parallel_tool_calls=False, temperature=0, max_tokens=120)
    choice = answer.choices[0]
    # a named function finishes with "stop", as OpenAI and vLLM answer it
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert call.function.name in parameters
    if tool_choice != "required":
        assert call.function.name == "get_weather"
    validates(call.function.arguments, parameters[call.function.name])

    stream = oai.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice=tool_choice,
                                         parallel_tool_calls=False, temperature=0, max_tokens=120, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    if tool_choice != "required":  # vLLM's JSON list for "required" is read when whole
        assert len(calls) > 1, "the arguments are streamed in pieces"
    assert calls[0].id.startswith("chatcmpl-tool-") and calls[0].function.name == call.function.name
    assert all(c.index == 0 for c in calls) and all(c.id is None for c in calls[1:])
    assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments
    assert deltas[-1].finish_reason == choice.finish_reason


# --- router protocol -------------------------------------------------------------------------------------------


def _router_text(shared_server, hf_tokenizer, **constraint) -> tuple[str, str]:  # noqa: F811
    request = vpb.GenerateRequest(request_id=f"so-{next(iter(constraint))}", text="Is Paris in France?",
                                  sampling_params=vpb.SamplingParams(temperature=0, max_tokens=64, **constraint))
    with grpc.insecure_channel(shared_server.target) as channel:
        replies = list(vgrpc.VllmEngineStub(channel).Generate(request, timeout=300))
    (complete,) = [r.complete for r in replies if r.WhichOneof("response") == "complete"]
    return hf_tokenizer.decode(list(complete.output_ids), skip_special_tokens=True), complete.finish_reason


def test_router_every_constraint_field(shared_server, default_model):  # noqa: F811
    tok = AutoTokenizer.from_pretrained(default_model.tokenizer_dir)
    text, finish = _router_text(shared_server, tok, json_schema=json.dumps(SCHEMAS["sentiment"]))
    assert finish == "stop"
    validates(text, SCHEMAS["sentiment"])
    assert re.fullmatch(PHONE, _router_text(shared_server, tok, regex=PHONE)[0])
    assert _router_text(shared_server, tok, choice=vpb.ChoiceConstraint(choices=ANSWERS))[0] in ANSWERS
    assert re.fullmatch(r"The answer is (yes|no)\.", _router_text(shared_server, tok, grammar=GRAMMAR)[0])
    assert isinstance(json.loads(_router_text(shared_server, tok, json_object=True)[0]), dict)


# --- dead ends -------------------------------------------------------------------------------------------------


def test_dead_end_finish_reason_on_every_surface(server_factory, tmp_path):  # noqa: F811
    """A model whose logits cover only token ids < 100 cannot write "zzz": the constrained request ends with the
    dead-end finish reason on each surface (not an error status), and the server goes on serving; that batch mates
    keep their tokens through a dead end is tests/test_structured_scheduling.py's."""
    from conftest import make_tiny_model

    server = server_factory("--model", str(make_tiny_model(tmp_path / "tiny", vocab_size=100, seed=4)),
                            "--dtype", "float32", "--http-port", "0")
    prompt = [5, 6, 7]
    with Client(server.target, timeout=120) as client:
        dead = client.complete(prompt, temperature=0, max_new_tokens=8, constraint=Choice(["zzz"]))
        assert dead.finish_reason is FinishReason.CONSTRAINT_DEAD_END and dead.text == ""
        assert client.complete(prompt, temperature=0, max_new_tokens=8, ignore_eos=True).final.usage \
            .completion_tokens == 8
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as oai:
        kwargs = dict(model=oai.models.list().data[0].id, prompt=prompt, temperature=0, max_tokens=8,
                      extra_body={"guided_choice": ["zzz"]})
        assert oai.completions.create(**kwargs).choices[0].finish_reason == "constraint_dead_end"
        chunks = [c for c in oai.completions.create(**kwargs, stream=True) if c.choices]
        assert chunks[-1].choices[0].finish_reason == "constraint_dead_end"
    request = vpb.GenerateRequest(request_id="dead-end", tokenized=vpb.TokenizedInput(input_ids=prompt),
                                  sampling_params=vpb.SamplingParams(
                                      temperature=0, max_tokens=8, choice=vpb.ChoiceConstraint(choices=["zzz"])))
    with grpc.insecure_channel(server.target) as channel:
        replies = list(vgrpc.VllmEngineStub(channel).Generate(request, timeout=120))
        (complete,) = [r.complete for r in replies if r.WhichOneof("response") == "complete"]
        assert complete.finish_reason == "constraint_dead_end" and not complete.output_ids
        wait_until(lambda: engine_idle(channel), 30, "no request or KV block left behind")
