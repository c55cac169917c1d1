"""pagedserve.v1 GenerateRequest -> the engine's GenerationRequest, admitted once (engine/admission.py).

Field mapping only: which oneof carries the prompt, which optional fields are set, proto units. Every value check
happens in SamplingParams or the admission; their errors are renamed to the proto path the client set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.engine.constraint import OutputConstraint, from_oneof
from pagedserve.engine.errors import InvalidRequestError, field_map, renamed
from pagedserve.engine.loading.chat_template import ChatMessage, ChatOptions
from pagedserve.engine.requests import AdmittedRequest, ChatPrompt, GenerationRequest, Prompt, TextPrompt, TokensPrompt
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.service.core.stream import StreamOptions
from pagedserve.v1 import generate_pb2 as pb

# Admission and SamplingParams field -> the GenerateRequest field path a client sets.
PROTO_FIELDS = field_map({
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "repetition_penalty": "sampling.repetition_penalty",
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "seed": "sampling.seed",
    "logit_bias": "sampling.logit_bias",
    "thinking_token_budget": "sampling.thinking_token_budget",
    "max_tokens": "stopping.max_new_tokens",
    "min_tokens": "stopping.min_new_tokens",
    "stop": "stopping.stop_sequences",
    "stop_token_ids": "stopping.stop_token_ids",
    "logprobs": "response.logprobs",
    "prompt_logprobs": "response.prompt_logprobs",
    "prompt": "text",
    "prompt_token_ids": "token_ids.ids",
    "messages": "chat.messages",
    "chat_template": "chat.chat_template",
    "truncate_prompt_tokens": "truncate_input_tokens",
})


def _proto_field(field: str) -> str:
    # The engine's `constraint.<kind>` is the oneof's path already, except choice's list inside its message.
    if field.startswith("constraint.choice"):
        return "constraint.choice.choices" + field[len("constraint.choice"):]
    return PROTO_FIELDS(field)


@dataclass(frozen=True, slots=True)
class V1Request:
    admitted: AdmittedRequest
    stream_mode: int  # pb.StreamMode value
    options: StreamOptions  # heartbeats and the time limit


Admit = Callable[[GenerationRequest], AdmittedRequest]


def admit(request: pb.GenerateRequest, engine_admit: Admit) -> V1Request:
    with renamed(_proto_field):
        admitted = engine_admit(generation_request(request))
    heartbeat_ms = request.response.heartbeat_ms  # 0 or unset: no heartbeats
    options = StreamOptions(heartbeat_s=heartbeat_ms / 1000 or None, time_limit_s=_time_limit_s(request.stopping))
    return V1Request(admitted, request.response.stream_mode, options)


def generation_request(request: pb.GenerateRequest) -> GenerationRequest:
    stopping = request.stopping
    truncate = request.truncate_input_tokens if request.HasField("truncate_input_tokens") else None
    return GenerationRequest(_prompt(request), sampling_params(request),
                             max_tokens_is_default=not stopping.HasField("max_new_tokens"),
                             truncate_prompt_tokens=truncate, adapter=request.adapter or None,
                             cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
                             priority=request.priority)


def _time_limit_s(stopping: pb.StoppingOptions) -> float | None:
    if not stopping.HasField("time_limit_ms"):
        return None
    if stopping.time_limit_ms < 1:
        raise InvalidRequestError("stopping.time_limit_ms", "must be >= 1 (leave unset for no limit)")
    return stopping.time_limit_ms / 1000


def sampling_params(request: pb.GenerateRequest) -> SamplingParams:
    s, t, r = request.sampling, request.stopping, request.response
    kwargs: dict[str, object] = {}
    _copy_optional(kwargs, s, ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                "presence_penalty", "frequency_penalty", "seed", "thinking_token_budget"))
    _copy_optional(kwargs, request, ("n",))
    _copy_optional(kwargs, t, ("ignore_eos",))
    for proto_name, engine_name in (("max_new_tokens", "max_tokens"), ("min_new_tokens", "min_tokens"),
                                    ("include_stop_sequence", "include_stop_str_in_output")):
        if t.HasField(proto_name):
            kwargs[engine_name] = getattr(t, proto_name)
    for name in ("logprobs", "prompt_logprobs"):
        if r.HasField(name):
            kwargs[name] = getattr(r, name)
    if t.stop_sequences:
        kwargs["stop"] = tuple(t.stop_sequences)
    if t.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(t.stop_token_ids)
    if s.logit_bias:
        kwargs["logit_bias"] = dict(s.logit_bias)
    if request.HasField("constraint"):
        kwargs["constraint"] = output_constraint(request.constraint)
    return SamplingParams(**kwargs)


def output_constraint(constraint: pb.Constraint) -> OutputConstraint:
    """The oneof's names are the engine's kinds, so its errors (`constraint.<kind>`) already name the proto path."""
    which = constraint.WhichOneof("kind")
    if which is None:
        raise InvalidRequestError("constraint", "set one of json_schema, json_object, regex, grammar, choice or "
                                                "structural_tag (or leave constraint unset)")
    return from_oneof(constraint, which)


def _copy_optional(kwargs: dict[str, object], message: object, names: tuple[str, ...]) -> None:
    for name in names:
        if message.HasField(name):
            kwargs[name] = getattr(message, name)


def _prompt(request: pb.GenerateRequest) -> Prompt:
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidRequestError("input", "set one of text, token_ids or chat")
    special = request.add_special_tokens if request.HasField("add_special_tokens") else None
    if which == "text":
        return TextPrompt(request.text, True if special is None else special)
    if which == "token_ids":
        return TokensPrompt(tuple(request.token_ids.ids))
    chat = request.chat
    options = ChatOptions(
        template=chat.chat_template if chat.HasField("chat_template") else None,
        add_generation_prompt=chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True)
    messages = tuple(ChatMessage(m.role, m.content, reasoning=m.reasoning if m.HasField("reasoning") else None)
                     for m in chat.messages)
    return ChatPrompt(messages, options, False if special is None else special)


def input_chars(request: pb.GenerateRequest) -> int:
    """How much text admission will tokenize (long prompts are admitted off the event loop)."""
    which = request.WhichOneof("input")
    if which == "text":
        return len(request.text)
    if which == "chat":
        return sum(len(m.content) for m in request.chat.messages) + len(request.chat.chat_template)
    return 0
