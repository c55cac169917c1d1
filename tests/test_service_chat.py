"""Chat input over pagedserve.v1: the prompt is the chat template's, errors name `chat.*` fields, the CLI chats."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from chat_templates import QWEN2
from service_fixtures import shared_server  # noqa: F401 - fixtures by name

from pagedserve.client import Client, ClientError, GenerateOptions, Message, build_request
from pagedserve.engine.errors import MissingChatTemplateError
from pagedserve.service.core.errors import to_rpc_error
from pagedserve.service.openai.openai_errors import error_reply

CONVERSATION = [Message("system", "Answer in one word."), Message("user", "Capital of France?"),
                Message("assistant", "Paris."), Message("user", "And of Italy?")]


@pytest.fixture(scope="module")
def client(shared_server) -> Client:  # noqa: F811
    with Client(shared_server.target, timeout=120) as c:
        yield c


def _dicts(messages: list[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


@pytest.mark.parametrize("options", [{}, {"add_generation_prompt": False}, {"chat_template": QWEN2}],
                         ids=["model-template", "no-generation-prompt", "request-template"])
def test_prompt_is_the_chat_template_rendering(client, hf_reference, options):
    tok = hf_reference[1]
    expected_ids = tok.apply_chat_template(
        _dicts(CONVERSATION), chat_template=options.get("chat_template"),
        add_generation_prompt=options.get("add_generation_prompt", True), return_dict=False)
    as_chat = client.complete(CONVERSATION, temperature=0, max_new_tokens=8, **options)
    as_ids = client.complete(list(expected_ids), temperature=0, max_new_tokens=8)
    assert as_chat.final.usage.prompt_tokens == len(expected_ids)
    assert as_chat.token_ids == as_ids.token_ids and as_chat.text == as_ids.text


@pytest.mark.parametrize(("messages", "options", "field"), [
    ([], {}, "chat.messages"),
    ([Message("user", "hi"), Message("wizard", "x")], {}, "chat.messages[1].role"),
    ([Message("user", "hi")], {"chat_template": "{% for %}"}, "chat.chat_template"),
    ([Message("assistant", "hi")], {"chat_template": "{{ raise_exception('user first') }}"}, "chat.messages"),
    ([Message("user", "hi")], {"chat_template": "{% if false %}x{% endif %}"}, "chat"),
])
def test_bad_chat_input_is_invalid_argument_naming_the_field(client, messages, options, field):
    request = build_request(messages or [Message("user", "placeholder")], GenerateOptions(max_new_tokens=2, **options))
    if not messages:
        del request.chat.messages[:]
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate_raw(request))
    error = ClientError.from_rpc(info.value)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.field == field


def test_model_info_says_a_template_is_present(client):
    assert client.model_info().has_chat_template


def test_missing_template_is_failed_precondition_and_http_400():
    exc = MissingChatTemplateError("model 'tiny' has no chat template")
    assert to_rpc_error(exc).code == grpc.StatusCode.FAILED_PRECONDITION
    reply = error_reply(exc)
    assert reply.status == 400 and reply.body["error"]["param"] == "messages"
    assert "'tiny' has no chat template" in reply.body["error"]["message"]


def test_cli_chat_prints_the_answer(client, shared_server):  # noqa: F811
    expected = client.complete([Message("user", "What is the capital of France?")], temperature=0, max_new_tokens=12)
    done = subprocess.run([sys.executable, "-m", "pagedserve.client.cli", "--target", shared_server.target, "chat",
                           "What is the capital of France?", "--temperature", "0", "--max-new-tokens", "12"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected.text + "\n" and "Paris" in expected.text
