"""GenerateRequest (proto) -> what the engine takes: a prompt of token ids and SamplingParams.

Validation the engine cannot do without the proto (which oneof is set, prompt vs context, vocabulary) lives here;
value checks stay in SamplingParams, and their field names are translated to the proto paths the client used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pagedserve.engine.chat_template import ChatMessage, ChatOptions, check_messages
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.v1 import generate_pb2 as pb

# SamplingParams field -> the GenerateRequest field path a client sets.
ENGINE_TO_PROTO_FIELD = {
    "n": "n",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "repetition_penalty": "sampling.repetition_penalty",
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "seed": "sampling.seed",
    "logit_bias": "sampling.logit_bias",
    "max_tokens": "stopping.max_new_tokens",
    "min_tokens": "stopping.min_new_tokens",
    "stop": "stopping.stop_sequences",
    "stop_token_ids": "stopping.stop_token_ids",
    "logprobs": "response.logprobs",
    "prompt": "text",
    "prompt_token_ids": "token_ids.ids",
}


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What validation needs to know about the loaded model."""

    vocab_size: int
    max_context_length: int
    encode: Callable[[str, bool], list[int]]  # (text, add_special_tokens) -> token ids
    render_chat: Callable[[tuple[ChatMessage, ...], ChatOptions], str]  # the chat template


@dataclass(frozen=True, slots=True)
class EngineRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    truncated: bool
    stream_mode: int  # pb.StreamMode value
    heartbeat_s: float | None
    time_limit_s: float | None


def to_engine_request(request: pb.GenerateRequest, facts: ModelFacts) -> EngineRequest:
    prompt, truncated = _prompt_ids(request, facts)
    params = _fit_context(sampling_params(request), request, len(prompt), facts.max_context_length)
    with proto_field_names():
        params.check_vocab(facts.vocab_size)
    heartbeat_ms = request.response.heartbeat_ms  # 0 or unset: no heartbeats
    return EngineRequest(prompt_token_ids=prompt, params=params, truncated=truncated,
                         stream_mode=request.response.stream_mode, heartbeat_s=heartbeat_ms / 1000 or None,
                         time_limit_s=_time_limit_s(request.stopping))


def _fit_context(params: SamplingParams, request: pb.GenerateRequest, prompt_len: int, context: int) -> SamplingParams:
    """An unset max_new_tokens shrinks to the room left in the context; a set one that does not fit is an error."""
    room = context - prompt_len
    if params.max_tokens > room and not request.stopping.HasField("max_new_tokens"):
        return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
    if params.max_tokens > room:
        raise InvalidRequestError(
            "stopping.max_new_tokens",
            f"{params.max_tokens} new tokens after a {prompt_len}-token prompt exceed the model's "
            f"context of {context} tokens (at most {room})")
    return params


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
                                "presence_penalty", "frequency_penalty", "seed"))
    _copy_optional(kwargs, request, ("n",))
    _copy_optional(kwargs, t, ("ignore_eos",))
    for proto_name, engine_name in (("max_new_tokens", "max_tokens"), ("min_new_tokens", "min_tokens"),
                                    ("include_stop_sequence", "include_stop_str_in_output")):
        if t.HasField(proto_name):
            kwargs[engine_name] = getattr(t, proto_name)
    if r.HasField("logprobs"):
        kwargs["logprobs"] = r.logprobs
    if t.stop_sequences:
        kwargs["stop"] = tuple(t.stop_sequences)
    if t.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(t.stop_token_ids)
    if s.logit_bias:
        kwargs["logit_bias"] = dict(s.logit_bias)
    with proto_field_names():
        return SamplingParams(**kwargs)


@contextmanager
def proto_field_names() -> Iterator[None]:
    """Re-raise engine validation errors under the proto field path the client actually set."""
    try:
        yield
    except InvalidRequestError as exc:
        field = ENGINE_TO_PROTO_FIELD.get(exc.field, exc.field)
        raise InvalidRequestError(field, exc.message) from None


def _copy_optional(kwargs: dict[str, object], message: object, names: tuple[str, ...]) -> None:
    for name in names:
        if message.HasField(name):
            kwargs[name] = getattr(message, name)


def _prompt_ids(request: pb.GenerateRequest, facts: ModelFacts) -> tuple[list[int], bool]:
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidRequestError("input", "set one of text, token_ids or chat")
    if which == "chat":
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else False
        ids = facts.encode(chat_prompt(request.chat, facts.render_chat), add_special)
        if not ids:
            raise InvalidRequestError("chat", "the chat template rendered an empty prompt")
    elif which == "text":
        if not request.text:
            raise InvalidRequestError("text", "prompt is empty")
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = facts.encode(request.text, add_special)
    else:
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidRequestError("token_ids.ids", "prompt is empty")
        for i, token in enumerate(ids):
            if token >= facts.vocab_size:
                raise InvalidRequestError(
                    f"token_ids.ids[{i}]", f"token id {token} is outside the vocabulary (size {facts.vocab_size})")
    truncated = False
    if request.HasField("truncate_input_tokens"):
        keep = request.truncate_input_tokens
        if keep < 1:
            raise InvalidRequestError("truncate_input_tokens", f"must be >= 1, got {keep}")
        truncated = len(ids) > keep
        ids = ids[-keep:]
    if len(ids) >= facts.max_context_length:
        raise InvalidRequestError(
            "token_ids.ids" if which == "token_ids" else which,
            f"prompt is {len(ids)} tokens; the model's context is {facts.max_context_length} tokens and at least "
            f"one must be left to generate (set truncate_input_tokens to keep only the last tokens)")
    return ids, truncated


def chat_prompt(chat: pb.Chat, render: Callable[[tuple[ChatMessage, ...], ChatOptions], str]) -> str:
    """The conversation rendered with the chat template; errors name `chat.*` fields."""
    messages = check_messages([ChatMessage(m.role, m.content) for m in chat.messages], "chat.messages")
    options = ChatOptions(
        template=chat.chat_template if chat.HasField("chat_template") else None,
        add_generation_prompt=chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True)
    with _renamed({"chat_template": "chat.chat_template", "messages": "chat.messages"}):
        return render(messages, options)


@contextmanager
def _renamed(names: dict[str, str]) -> Iterator[None]:
    try:
        yield
    except InvalidRequestError as exc:
        raise InvalidRequestError(names.get(exc.field, exc.field), exc.message) from None
