"""OpenAI request JSON -> the engine's GenerationRequests (one per prompt), admitted once, naming OpenAI's parameters.

Value checks are not repeated here: raw JSON values go straight into SamplingParams and the admission (prompt,
chat template, context), whose typed errors name the engine field; `OpenAIRequest.param` translates that name back
to the parameter the client set. This module only knows which OpenAI parameters exist, which are ignored (as OpenAI
ignores them), which are refused as unsupported, and how their shapes map onto the engine's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.admission import CHAT_FIELD, TEXT_FIELD, TOKENS_FIELD
from pagedserve.engine.constraint import field_under
from pagedserve.engine.errors import InvalidRequestError, field_map, renamed
from pagedserve.engine.reasoning import ReasoningFormat
from pagedserve.engine.requests import (
    TRUNCATE_TO_CONTEXT, AdmittedRequest, ChatPrompt, GenerationRequest, Prompt, TextPrompt, TokensPrompt,
)
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.service.core.request_policy import RequestPolicy
from pagedserve.service.openai.openai_constraints import STRUCTURED_PARAMS, RequestedConstraint, requested_constraint
from pagedserve.service.openai.openai_messages import chat_shape, flag
from pagedserve.service.openai.openai_reasoning import ReasoningPlan, reasoning_plan
from pagedserve.service.openai.openai_tools import ToolPlan, ToolSettings, tool_plan

# OpenAI's own parameters, plus vLLM's extensions that the same clients send.
_COMMON = frozenset({
    "model", "stream", "stream_options", "n", "temperature", "top_p", "max_tokens", "stop", "seed", "logprobs",
    "presence_penalty", "frequency_penalty", "logit_bias", "user",
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "add_special_tokens",
    "return_token_ids", "truncate_prompt_tokens", "priority", "bad_words", "allowed_token_ids", "prompt_logprobs",
    "request_id", "use_beam_search", "length_penalty", "logits_processors", "return_tokens_as_token_ids",
    "cache_salt", "kv_transfer_params", "vllm_xargs", "thinking_token_budget", *STRUCTURED_PARAMS,
})
COMPLETION_PARAMS = _COMMON | {"prompt", "echo", "best_of", "suffix", "prompt_embeds"}
# vLLM extras that would change the answer in ways this server does not do: refused naming why, never ignored.
_REFUSED = {
    "use_beam_search": "beam search is not supported; sample n answers instead",
    "logits_processors": "is not supported: the server runs no code sent with a request",
    "prompt_embeds": "is not supported: prompts are text or token ids",
    "kv_transfer_params": "is not supported: this server does no disaggregated prefill",
}
CHAT_PARAMS = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "metadata", "store", "service_tier", "parallel_tool_calls",
    "tools", "tool_choice", "response_format", "chat_template", "add_generation_prompt", "reasoning_effort",
    "prompt_cache_key", "safety_identifier", "modalities", "audio", "prediction", "functions", "function_call",
    "web_search_options", "verbosity", "chat_template_kwargs", "continue_final_message", "documents",
    "echo", "include_reasoning",
}

# OpenAI parameter -> SamplingParams field, where the value passes unchanged.
_DIRECT = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
           "seed", "stop", "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
           "allowed_token_ids", "bad_words", "skip_special_tokens", "thinking_token_budget")
# Integer parameters: a JSON number with no fraction (16.0, as Java's Double or Python's arithmetic writes it) is
# that integer, as vLLM's pydantic models read it; 16.5 still reaches SamplingParams and is refused naming the field.
# Chat's `logprobs` is a boolean and stays out.
_CHAT_INTEGERS = frozenset({
    "n", "best_of", "max_tokens", "max_completion_tokens", "seed", "top_k", "min_tokens", "top_logprobs",
    "prompt_logprobs", "truncate_prompt_tokens", "priority", "thinking_token_budget",
})
_COMPLETION_INTEGERS = _CHAT_INTEGERS | {"logprobs"}
POOLING_INTEGERS = frozenset({"dimensions", "truncate_prompt_tokens", "priority", "top_n", "max_tokens_per_query",
                              "max_tokens_per_doc"})  # /v1/embeddings, /score, /rerank

MAX_BATCH = 64  # prompts in one /v1/completions request
_WARNED: set[str] = set()  # unknown field names already logged
_MAX_WARNED = 256
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromptInput:
    request: GenerationRequest
    text: str  # for `echo`; empty for token-id prompts
    field: str  # the parameter that carries this prompt: "prompt", "prompt[3]" or "messages"


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    chat: bool
    model: str | None
    prompts: tuple[PromptInput, ...]  # one for chat; completions take a batch (choice index = prompt * n + i)
    stream: bool
    include_usage: bool
    continuous_usage: bool  # vLLM's stream_options.continuous_usage_stats: running usage on every chunk
    return_token_ids: bool  # vLLM's return_token_ids: each choice (or chunk) carries its token ids
    echo: bool
    names: dict[str, str]  # engine field -> the OpenAI parameter the client set
    constraint_param: str | None = None  # where the constraint came from: its errors name this path
    tools: ToolPlan = ToolPlan(None)  # tools rendered, forced, or read back from the text (openai_tools.py)
    adapter: str | None = None  # the LoRA adapter `model` named (None: the base)
    reasoning: ReasoningPlan | None = None  # chat with --reasoning-parser: the thought answered apart from content
    role: str = "assistant"  # a chat answer's role: --response-role, or the last message's when it continues it
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:42"

    @property
    def params(self) -> SamplingParams:
        """What every prompt shares (n, logprobs, stops); admission may lower max_tokens per prompt."""
        return self.prompts[0].request.params

    def param(self, engine_field: str) -> str:
        if self.constraint_param is not None:
            renamed_field = field_under(engine_field, self.constraint_param)
            if renamed_field != engine_field:
                return renamed_field
        return self.names.get(engine_field, engine_field)

    def admit(self, engine_admit: Callable[[GenerationRequest], AdmittedRequest]) -> tuple[AdmittedRequest, ...]:
        """Each prompt admitted once; errors name the parameter, and the prompt of a batch, the client sent."""
        admitted = []
        for prompt in self.prompts:
            names = {**self.names, TEXT_FIELD: prompt.field, TOKENS_FIELD: prompt.field, CHAT_FIELD: prompt.field}
            with renamed(field_map(names)):
                admitted.append(engine_admit(prompt.request))
        return tuple(admitted)


def parse(body: Any, chat: bool, adapter: str | None = None, tools: ToolSettings = ToolSettings(),
          policy: RequestPolicy = RequestPolicy(), reasoning: ReasoningFormat | None = None) -> OpenAIRequest:
    """adapter: the LoRA adapter `model` names (OpenAIApi.check_model), set on every prompt's request; tools: the
    server's tool-call flags; policy: its sampling defaults (--generation-config) and limits; reasoning: the
    engine's thought markers (--reasoning-parser)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", f"must be a JSON object, got {type(body).__name__}")
    body = integral_floats({k: v for k, v in body.items() if v is not None},  # SDKs send null: not given
                           _CHAT_INTEGERS if chat else _COMPLETION_INTEGERS)
    check_known(body, CHAT_PARAMS if chat else COMPLETION_PARAMS)
    _refuse_unsupported(body, chat)
    if chat:
        body = policy.with_template_defaults(body)  # --default-chat-template-kwargs under the request's own
    names = _names(body, chat)
    requested, plan = _constraint(body, chat, tools)
    thoughts = reasoning_plan(body, chat, reasoning)
    shapes = [chat_shape(body, plan)] if chat else _completion_prompts(body)
    logprobs = _chat_logprobs(body) if chat else body.get("logprobs")  # its own errors already name OpenAI's fields
    _check_logprobs(logprobs, "top_logprobs" if chat else "logprobs", policy)
    _check_logprobs(body.get("prompt_logprobs"), "prompt_logprobs", policy)
    # No max_tokens: the room left in the context (chat) or 16 within it (completions); a set one must fit.
    default = "max_completion_tokens" not in body and "max_tokens" not in body
    body = _with_defaults(body, policy, default)
    if plan.format is not None and plan.format.keeps_special_tokens:
        body = {**body, "skip_special_tokens": False}
    with renamed(field_map(names)):
        params = _sampling_params(body, chat, logprobs, requested)
    truncate = _truncate(body)
    prompts = tuple(PromptInput(GenerationRequest(prompt, params, max_tokens_is_default=default, adapter=adapter,
                                                  truncate_prompt_tokens=truncate, cache_salt=body.get("cache_salt"),
                                                  priority=body.get("priority", 0)),
                                text, field)
                    for prompt, text, field in shapes)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options", {})
    if "stream_options" in body and (not stream or not isinstance(options, dict)):
        raise InvalidRequestError("stream_options", "is only allowed with stream: true, as an object")
    # vLLM's rule: --enable-force-include-usage gives a stream both its usage chunk and usage on every chunk;
    # otherwise continuous_usage_stats counts only beside include_usage
    forced = stream and policy.force_include_usage
    include_usage = forced or _bool(options, "include_usage", False)
    continuous = _bool(options, "continuous_usage_stats", False)  # read (and type-checked) either way
    return OpenAIRequest(
        chat=chat, model=model_field(body), prompts=prompts, stream=stream, include_usage=include_usage,
        continuous_usage=forced or (include_usage and continuous),
        return_token_ids=_bool(body, "return_token_ids", False), echo=_bool(body, "echo", False), names=names,
        constraint_param=requested.param if requested else None, tools=plan, adapter=adapter, reasoning=thoughts,
        role=_role(shapes[0][0], policy) if chat else "assistant",
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids", policy.return_tokens_as_token_ids))


def _role(prompt: ChatPrompt, policy: RequestPolicy) -> str:
    """vLLM's rule: a new turn is the server's --response-role; a continued one keeps the last message's role."""
    return policy.response_role if prompt.options.add_generation_prompt else prompt.messages[-1].role


def _constraint(body: dict[str, Any], chat: bool,
                settings: ToolSettings) -> tuple[RequestedConstraint | None, ToolPlan]:
    """At most one: a structured-output parameter or a forced tool call."""
    requested = requested_constraint(body)
    plan = tool_plan(body, settings) if chat else ToolPlan(None)
    if plan.constraint is None:
        return requested, plan
    if requested is not None:
        raise InvalidRequestError("tool_choice", f"a forced tool call constrains the output already; "
                                                 f"{requested.param.split('.')[0]} cannot be set with it")
    return plan.constraint, plan


def integral_floats(body: dict[str, Any], integer: frozenset[str]) -> dict[str, Any]:
    """`body` with the integer parameters' integral floats (16.0) as integers; fractions stay for the checks."""
    return {k: int(v) if k in integer and isinstance(v, float) and v.is_integer() else v for k, v in body.items()}


def check_known(body: dict[str, Any], known: frozenset[str]) -> None:
    """Unknown fields are ignored, as vLLM ignores them, with one warning per field name (a bounded set, so
    random names cannot grow it without end)."""
    for name in sorted(set(body) - known):
        if name not in _WARNED and len(_WARNED) < _MAX_WARNED:
            _WARNED.add(name)
            log.warning("ignoring the unknown request field %r (warned once per field name)", name[:64])


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    if body.get("functions"):
        raise InvalidRequestError("functions", "the deprecated functions are not supported; use tools")
    if body.get("function_call", "none") not in ("none", "auto"):
        raise InvalidRequestError("function_call", "the deprecated function_call is not supported; use tool_choice")
    for name in ("audio", "prediction", "web_search_options", "suffix"):
        if name in body:
            raise InvalidRequestError(name, "is not supported by this server")
    for name, reason in _REFUSED.items():
        if body.get(name) not in (None, False, [], {}):
            raise InvalidRequestError(name, reason)
    if body.get("modalities", ["text"]) != ["text"]:
        raise InvalidRequestError("modalities", "only [\"text\"] is supported")
    if "best_of" in body and body["best_of"] != body.get("n", 1):
        raise InvalidRequestError("best_of", "must equal n: ranking extra samples is not supported (vLLM's V1 "
                                  "engine dropped best_of too); ask for n samples and rank them yourself")
    if _bool(body, "stream", False):  # the prompt's logprobs come whole, with the response (vLLM refuses too)
        if body.get("prompt_logprobs") is not None:
            raise InvalidRequestError("prompt_logprobs", "is not available with stream: true")
        if _bool(body, "echo", False) and not chat and "logprobs" in body:
            raise InvalidRequestError("echo", "echo with logprobs is not available with stream: true (the prompt's "
                                      "logprobs come with the whole response)")


def _names(body: dict[str, Any], chat: bool) -> dict[str, str]:
    names = {"adapter": "model"}  # an adapter unloaded since check_model: 404 naming `model`
    if chat and "max_completion_tokens" in body:
        names["max_tokens"] = "max_completion_tokens"
    if chat and "top_logprobs" in body:
        names["logprobs"] = "top_logprobs"
    return names


def _with_defaults(body: dict[str, Any], policy: RequestPolicy, no_max_tokens: bool) -> dict[str, Any]:
    """The model's sampling defaults under what the request set (a default max_tokens still shrinks to fit)."""
    if not policy.sampling_defaults:
        return body
    defaults = {k: v for k, v in policy.sampling_defaults.items() if k != "max_tokens" or no_max_tokens}
    return {**defaults, **body}


def _check_logprobs(logprobs: Any, name: str, policy: RequestPolicy) -> None:
    if isinstance(logprobs, int) and not isinstance(logprobs, bool) and logprobs > policy.max_logprobs:
        raise InvalidRequestError(name, f"must be <= {policy.max_logprobs} (the server's --max-logprobs), "
                                  f"got {logprobs}")


def _truncate(body: dict[str, Any]) -> int | None:
    """vLLM's truncate_prompt_tokens: keep the last k prompt tokens; -1: as many as the context allows."""
    value = body.get("truncate_prompt_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < TRUNCATE_TO_CONTEXT):
        raise InvalidRequestError("truncate_prompt_tokens", f"must be an integer >= 1, or -1, got {value!r}")
    return value


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    return flag(body, name, default)


def model_field(body: dict[str, Any]) -> str | None:
    """The body's `model`, None when absent; anything but a string is refused naming the field."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("model", f"must be a string, got {model!r}")
    return model


def _sampling_params(body: dict[str, Any], chat: bool, logprobs: int | None,
                     requested: RequestedConstraint | None) -> SamplingParams:
    kwargs: dict[str, Any] = {name: body[name] for name in _DIRECT if name in body}
    if requested is not None:
        kwargs["constraint"] = requested.constraint
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    elif chat:
        kwargs["max_tokens"] = None  # until the context is full
    if "logit_bias" in body:
        kwargs["logit_bias"] = _logit_bias(body["logit_bias"])
    # completions' echo with logprobs scores the prompt too, with as many alternatives (vLLM's rule)
    echo_scored = not chat and logprobs is not None and _bool(body, "echo", False)
    kwargs["prompt_logprobs"] = body.get("prompt_logprobs", logprobs if echo_scored else None)
    return SamplingParams(**kwargs, logprobs=logprobs)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    top = body.get("top_logprobs")
    if not _bool(body, "logprobs", False):
        if top is not None:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        return None
    return 0 if top is None else top


def _logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias", "must be an object mapping token ids to biases")
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise InvalidRequestError("logit_bias", "keys must be token ids (integers as strings)") from None


def _completion_prompts(body: dict[str, Any]) -> list[tuple[Prompt, str, str]]:
    """A string or token ids, or a batch of either; (prompt, text for echo, its parameter) per prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        batch, fields = [prompt], ["prompt"]
    elif isinstance(prompt, list) and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        if len(prompt) > MAX_BATCH:
            raise InvalidRequestError("prompt", f"at most {MAX_BATCH} prompts per request, got {len(prompt)}")
        batch = prompt
        fields = ["prompt"] if len(prompt) == 1 else [f"prompt[{i}]" for i in range(len(prompt))]
    else:
        raise InvalidRequestError("prompt", "must be a string, a list of token ids, or a list of either")
    return [(TextPrompt(p, _bool(body, "add_special_tokens", True)), p, field) if isinstance(p, str)
            else (TokensPrompt(tuple(p)), "", field) for p, field in zip(batch, fields)]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
