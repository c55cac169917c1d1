"""Server-wide request defaults (service/core/request_policy.py) as the OpenAI parser applies them: vLLM's
--override-generation-config over the model's generation_config.json (or alone with `vllm`), --default-chat-template-
kwargs under a request's own chat_template_kwargs (also what /tokenize renders, and what turns a reasoning model's
thought off), --response-role for a new turn. The servers started with these flags: tests/test_cli_vllm_flags.py."""

from __future__ import annotations

import json

import pytest

from pagedserve.engine.errors import ConfigError, InvalidRequestError
from pagedserve.engine.reasoning import REASONING_FORMATS
from pagedserve.service.cli import build_parser, server_config
from pagedserve.service.core.request_policy import RequestPolicy, generation_defaults
from pagedserve.service.openai.openai_params import parse

USER = [{"role": "user", "content": "Hi"}]


def test_the_override_goes_over_the_models_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.9,
                                                                 "max_new_tokens": 64, "bos_token_id": 1}))
    assert generation_defaults("auto", tmp_path, {"temperature": 0.2, "max_new_tokens": 8}) == \
        {"temperature": 0.2, "top_p": 0.9, "max_tokens": 8}
    assert generation_defaults("vllm", tmp_path, {"top_k": 5}) == {"top_k": 5}  # vllm: the override alone
    with pytest.raises(ConfigError) as info:
        generation_defaults("auto", tmp_path, {"bos_token_id": 2})
    assert info.value.field == "override_generation_config.bos_token_id"


def test_default_template_kwargs_go_under_the_requests_own():
    policy = RequestPolicy(chat_template_kwargs={"enable_thinking": False, "tone": "dry"})
    request = parse({"messages": USER, "chat_template_kwargs": {"tone": "warm"}}, chat=True, policy=policy)
    kwargs = dict(request.prompts[0].request.prompt.options.kwargs)
    assert kwargs == {"enable_thinking": False, "tone": "warm"}
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs"):  # a malformed one is still refused
        parse({"messages": USER, "chat_template_kwargs": [1]}, chat=True, policy=policy)


def test_default_enable_thinking_false_turns_a_qwen3_thought_off():
    qwen3 = REASONING_FORMATS.get("qwen3")
    policy = RequestPolicy(chat_template_kwargs={"enable_thinking": False})
    assert parse({"messages": USER}, chat=True, policy=policy, reasoning=qwen3).reasoning.thinking_off
    assert not parse({"messages": USER, "chat_template_kwargs": {"enable_thinking": True}}, chat=True, policy=policy,
                     reasoning=qwen3).reasoning.thinking_off


def test_response_role_names_new_turns_only():
    policy = RequestPolicy(response_role="narrator")
    assert parse({"messages": USER}, chat=True, policy=policy).role == "narrator"
    continued = [*USER, {"role": "assistant", "content": "Hel"}]
    body = {"messages": continued, "add_generation_prompt": False, "continue_final_message": True}
    assert parse(body, chat=True, policy=policy).role == "assistant"


def test_the_flags_reach_the_policy():
    args = build_parser().parse_args(["serve", "--override-generation-config", '{"temperature": 0}',
                                      "--default-chat-template-kwargs", '{"enable_thinking": false}',
                                      "--response-role", "bot"])
    policy = server_config(args).request_policy(None)
    assert (policy.sampling_defaults, policy.chat_template_kwargs, policy.response_role) == \
        ({"temperature": 0}, {"enable_thinking": False}, "bot")
    for bad in ("[1]", "{not json"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--default-chat-template-kwargs", bad])
    with pytest.raises(ConfigError, match="response_role"):
        server_config(build_parser().parse_args(["serve", "--response-role", " "])).request_policy(None)


def test_return_tokens_as_token_ids_defaults_to_the_servers_flag():
    policy = RequestPolicy(return_tokens_as_token_ids=True)
    assert parse({"prompt": "Hi"}, chat=False, policy=policy).tokens_as_ids
    assert not parse({"prompt": "Hi", "return_tokens_as_token_ids": False}, chat=False, policy=policy).tokens_as_ids
    assert not parse({"prompt": "Hi"}, chat=False).tokens_as_ids
    args = build_parser().parse_args(["serve", "--return-tokens-as-token-ids"])
    assert server_config(args).request_policy(None).return_tokens_as_token_ids
