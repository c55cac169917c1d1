"""Keyword options -> GenerateRequest. Only options the caller passes are set, so server defaults apply to the rest."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from pagedserve.client.constraints import CONSTRAINT_TYPES, Constraint
from pagedserve.v1 import generate_pb2 as pb


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message; a list of them is a prompt rendered with the model's chat template."""

    role: str  # system, developer, user, assistant or tool
    content: str
    reasoning: str | None = None  # an assistant turn's thought, sent back as the server gave it (Completion.reasoning)


Prompt = str | Sequence[int] | Sequence[Message]


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    """Every field maps to one GenerateRequest field; None means "server default"."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    temperature: float | None = None  # 0: greedy
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    thinking_token_budget: int | None = None  # a reasoning model's thought takes at most this many tokens
    logit_bias: Mapping[int, float] | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool | None = None
    include_stop_sequence: bool | None = None
    time_limit_ms: int | None = None
    n: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # score the prompt: Started.prompt_logprobs, with this many alternatives
    final_only: bool = False
    heartbeat_ms: int | None = None
    add_special_tokens: bool | None = None
    truncate_input_tokens: int | None = None
    chat_template: str | None = None  # chat prompts only: a jinja template instead of the model's
    add_generation_prompt: bool | None = None  # chat prompts only (server default true)
    constraint: Constraint | None = None  # structured output: JsonSchema, JsonObject, Regex, Grammar, Choice, ...
    adapter: str | None = None  # a LoRA adapter's name (list_adapters()); None: the base model
    cache_salt: str | None = None  # share prefix-cache blocks only with requests of the same salt
    priority: int = 0  # lower goes first on a server started with --scheduling-policy priority
    request_id: str = ""

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> GenerateOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown generate option(s) {unknown}; supported: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]


_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
             "seed", "thinking_token_budget")
_STOPPING = ("max_new_tokens", "min_new_tokens", "ignore_eos", "include_stop_sequence", "time_limit_ms")


def build_request(prompt: Prompt, options: GenerateOptions) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=options.request_id, adapter=options.adapter or "",
                                 priority=options.priority)
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], Message):
        request.chat.messages.extend(pb.ChatMessage(role=m.role, content=m.content, reasoning=m.reasoning)
                                     for m in prompt)
        _set(request.chat, "chat_template", options.chat_template)
        _set(request.chat, "add_generation_prompt", options.add_generation_prompt)
    else:
        request.token_ids.ids.extend(prompt)
    for name in ("n", "add_special_tokens", "truncate_input_tokens", "cache_salt"):
        _set(request, name, getattr(options, name))
    for name in _SAMPLING:
        _set(request.sampling, name, getattr(options, name))
    for name in _STOPPING:
        _set(request.stopping, name, getattr(options, name))
    if options.logit_bias:
        request.sampling.logit_bias.update(options.logit_bias)
    request.stopping.stop_sequences.extend(options.stop)
    request.stopping.stop_token_ids.extend(options.stop_token_ids)
    _set(request.response, "logprobs", options.logprobs)
    _set(request.response, "prompt_logprobs", options.prompt_logprobs)
    _set(request.response, "heartbeat_ms", options.heartbeat_ms)
    if options.final_only:
        request.response.stream_mode = pb.STREAM_MODE_FINAL_ONLY
    if options.constraint is not None:
        if not isinstance(options.constraint, CONSTRAINT_TYPES):
            names = ", ".join(t.__name__ for t in CONSTRAINT_TYPES)
            raise TypeError(f"constraint must be one of {names}, got {type(options.constraint).__name__}")
        request.constraint.CopyFrom(options.constraint.to_proto())
    return request


def _set(message: object, name: str, value: object) -> None:
    if value is not None:
        setattr(message, name, value)
