"""Structured outputs on every front end of the shared server: each protocol's way of asking maps onto the engine's
constraint, and a bad spec is refused as that protocol refuses bad input (INVALID_ARGUMENT / HTTP 400) naming the
path the client set; the router learns where constraints start (GetServerInfo)."""

from __future__ import annotations

import grpc
import pytest
from service_fixtures import shared_server, stub  # noqa: F401 - fixtures by name
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc
from test_openai_http_errors import CHAT, COMPLETIONS, USER, post

from pagedserve.client import Choice, Client, ClientError, JsonSchema, Regex
from pagedserve.v1 import generate_pb2 as pb

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

HTTP_BAD = [  # (id, path, body, param)
    ("schema-not-a-schema", CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}}}, "response_format.json_schema.schema"),
    ("json-schema-missing", CHAT, {"messages": USER, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("response-format-type", CHAT, {"messages": USER, "response_format": {"type": "yaml"}}, "response_format.type"),
    ("strict-string", CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ("structured-outputs-two-kinds", CHAT, {"messages": USER, "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("structured-outputs-unknown-key", COMPLETIONS, {"prompt": "x", "structured_outputs": {"yaml": "a"}},
     "structured_outputs.yaml"),
    ("structured-outputs-empty-regex", COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": ""}},
     "structured_outputs.regex"),
    ("guided-json-not-json", COMPLETIONS, {"prompt": "x", "guided_json": "{not json"}, "guided_json"),
    ("guided-choice-empty-entry", CHAT, {"messages": USER, "guided_choice": ["yes", ""]}, "guided_choice[1]"),
    ("guided-choice-string", CHAT, {"messages": USER, "guided_choice": "yes"}, "guided_choice"),
    ("guided-regex-number", COMPLETIONS, {"prompt": "x", "guided_regex": 5}, "guided_regex"),
    ("two-parameters", CHAT, {"messages": USER, "guided_regex": "a+", "response_format": {"type": "json_object"}},
     "guided_regex"),
    ("tools-too-many", CHAT, {"messages": USER, "tools": [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ("tool-name-not-an-identifier", CHAT, {"messages": USER, "tools": [
        {"type": "function", "function": {"name": "get weather; rm -rf"}}]}, "tools[0].function.name"),
    ("parallel-tool-calls-string", CHAT, {"messages": USER, "tools": TOOLS, "parallel_tool_calls": "yes"},
     "parallel_tool_calls"),
    ("tool-call-arguments-not-json", CHAT, {"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("tool-message-id-not-a-string", CHAT, {"messages": [*USER, {"role": "tool", "content": "1",
                                                                  "tool_call_id": 5}]}, "messages[1].tool_call_id"),
    ("tools-auto-explicit", CHAT, {"messages": USER, "tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ("tool-choice-unknown-function", CHAT, {"messages": USER, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "launch"}}}, "tool_choice.function.name"),
    ("tool-choice-without-tools", CHAT, {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ("tool-without-name", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {}}],
                                 "tool_choice": "required"}, "tools[0].function.name"),
    ("tool-parameters-not-a-schema", CHAT, {"messages": USER, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    # Rejected by the grammar library at admission, renamed to the parameter the client set:
    ("regex-does-not-compile", COMPLETIONS, {"prompt": "x", "guided_regex": "(ab"}, "guided_regex"),
    ("schema-unknown-type", CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}}, "response_format.json_schema.schema"),
    ("grammar-does-not-compile", COMPLETIONS, {"prompt": "x", "structured_outputs": {"grammar": "start: missing"}},
     "structured_outputs.grammar"),
    ("tool-schema-does-not-compile", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "no-such-type"}}}], "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters"),
    ("tools-with-response-format", CHAT, {"messages": USER, "tools": TOOLS, "tool_choice": "required",
                                          "response_format": {"type": "json_object"}}, "tool_choice"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in HTTP_BAD], ids=[c[0] for c in HTTP_BAD])
def test_openai_bad_constraint_is_400_naming_the_parameter(shared_server, path, body, param):  # noqa: F811
    status, reply = post(shared_server.http_port, path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["message"].startswith(param), reply


def test_openai_text_response_format_and_tool_choice_none_are_plain_text(shared_server):  # noqa: F811
    """Without --enable-auto-tool-choice, tools without tool_choice are answered as "none" (never a 400); the
    default template renders no tools, so the answer is the plain one."""
    plain = {"messages": USER, "temperature": 0, "max_tokens": 6}
    status, expected = post(shared_server.http_port, CHAT, plain)
    assert status == 200
    for extra in ({"response_format": {"type": "text"}}, {"tools": TOOLS, "tool_choice": "none"}, {"tools": TOOLS}):
        status, reply = post(shared_server.http_port, CHAT, {**plain, **extra})
        assert status == 200 and reply["choices"][0]["message"] == expected["choices"][0]["message"], extra


V1_BAD = [  # (id, constraint, field)
    ("schema-not-json", pb.Constraint(json_schema="{"), "constraint.json_schema"),
    ("schema-a-list", pb.Constraint(json_schema="[1]"), "constraint.json_schema"),
    ("empty-regex", pb.Constraint(regex=""), "constraint.regex"),
    ("empty-grammar", pb.Constraint(grammar=""), "constraint.grammar"),
    ("no-choices", pb.Constraint(choice=pb.Choices()), "constraint.choice.choices"),
    ("empty-choice", pb.Constraint(choice=pb.Choices(choices=["a", ""])), "constraint.choice.choices[1]"),
    ("tag-not-an-object", pb.Constraint(structural_tag="[]"), "constraint.structural_tag"),
    ("kind-unset", pb.Constraint(), "constraint"),
    ("regex-does-not-compile", pb.Constraint(regex="(ab"), "constraint.regex"),
    ("schema-unknown-type", pb.Constraint(json_schema='{"type": "no-such-type"}'), "constraint.json_schema"),
]


@pytest.mark.parametrize(("constraint", "field"), [c[1:] for c in V1_BAD], ids=[c[0] for c in V1_BAD])
def test_v1_bad_constraint_is_invalid_argument_naming_the_field(shared_server, constraint, field):  # noqa: F811
    request = pb.GenerateRequest(text="Hi", constraint=constraint, stopping=pb.StoppingOptions(max_new_tokens=2))
    with grpc.insecure_channel(shared_server.target) as channel, pytest.raises(grpc.RpcError) as caught:
        list(stub(channel).Generate(request, timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}:"), caught.value.details()


def test_python_client_sends_typed_constraints(shared_server):  # noqa: F811
    with Client(shared_server.target, timeout=60) as client:
        for constraint, field in ((JsonSchema("{"), "constraint.json_schema"), (Regex(""), "constraint.regex"),
                                  (Choice(["a", ""]), "constraint.choice.choices[1]")):
            with pytest.raises(ClientError) as caught:
                client.complete("Hi", max_new_tokens=2, constraint=constraint)
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert str(caught.value.details).startswith(f"{field}:"), caught.value
        with pytest.raises(TypeError, match="constraint must be one of"):
            client.complete("Hi", max_new_tokens=2, constraint={"type": "object"})
    with pytest.raises(TypeError, match="list of strings"):
        Choice("yes")


ROUTER_BAD = [  # (id, SamplingParams constraint fields, field)
    ("schema-not-json", {"json_schema": "{"}, "sampling_params.json_schema"),
    ("empty-regex", {"regex": ""}, "sampling_params.regex"),
    ("empty-grammar", {"grammar": ""}, "sampling_params.grammar"),
    ("empty-choice", {"choice": vpb.ChoiceConstraint(choices=["a", ""])}, "sampling_params.choice.choices[1]"),
    ("tag-not-json", {"structural_tag": "x"}, "sampling_params.structural_tag"),
    ("grammar-does-not-compile", {"grammar": "start: missing"}, "sampling_params.grammar"),
    ("schema-unknown-type", {"json_schema": '{"type": "no-such-type"}'}, "sampling_params.json_schema"),
]


@pytest.mark.parametrize(("fields", "field"), [c[1:] for c in ROUTER_BAD], ids=[c[0] for c in ROUTER_BAD])
def test_router_bad_constraint_is_invalid_argument_naming_the_field(shared_server, fields, field):  # noqa: F811
    request = vpb.GenerateRequest(request_id="bad-constraint", text="Hi",
                                  sampling_params=vpb.SamplingParams(max_tokens=2, **fields))
    with grpc.insecure_channel(shared_server.target) as channel, pytest.raises(grpc.RpcError) as caught:
        list(vgrpc.VllmEngineStub(channel).Generate(request, timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}:"), caught.value.details()


def test_router_learns_constraints_start_at_the_first_token(shared_server):  # noqa: F811
    with grpc.insecure_channel(shared_server.target) as channel:
        info = vgrpc.VllmEngineStub(channel).GetServerInfo(vpb.GetServerInfoRequest(), timeout=30)
    assert info.constrained_decoding_start == "first_token"
