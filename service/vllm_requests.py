"""vllm.grpc.engine GenerateRequest -> the engine's request (token ids + SamplingParams).

Field mapping only: value checks stay in SamplingParams and prompt/context checks in the shared rules of
service/requests.py; their errors are renamed to the vLLM proto path the router set. Every field the engine
cannot honour is refused by name when it is set, never silently dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from google.protobuf import unknown_fields
from google.protobuf.message import Message
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.service.requests import EngineRequest, ModelFacts

SP = "sampling_params"
# SamplingParams field -> the vLLM proto field path.
_ENGINE_TO_PROTO = {name: f"{SP}.{name}" for name in (
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "seed", "logit_bias", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logprobs")}
# proto3 scalars without presence: 0 means "not set" (what vLLM's own servicer assumes too).
_ZERO_IS_UNSET = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "n",
                  "min_tokens")
# Set on a request, these need machinery the engine does not have: INVALID_ARGUMENT naming them.
_UNSUPPORTED_SAMPLING = ("prompt_logprobs", "grammar_from_first_token")
_UNSUPPORTED_REQUEST = ("kv_transfer_params", "mm_inputs", "extra_mm_inputs", "kv_transfer_params_json",
                        "media_refs")


def to_engine_request(request: vpb.GenerateRequest, facts: ModelFacts) -> EngineRequest:
    _refuse_unsupported(request)
    prompt = _prompt_ids(request, facts)
    params = _sampling_params(request.sampling_params)
    params = _fit_context(params, request.sampling_params, len(prompt), facts.max_context_length)
    with _proto_names():
        params.check_vocab(facts.vocab_size)
    return EngineRequest(prompt_token_ids=prompt, params=params, truncated=False, stream_mode=0,
                         heartbeat_s=None, time_limit_s=None)


def _refuse_unsupported(request: vpb.GenerateRequest) -> None:
    for message, name in ((request, "request"), (request.sampling_params, SP)):
        unknown = unknown_fields.UnknownFieldSet(message)
        if len(unknown):
            numbers = sorted({f.field_number for f in unknown})
            raise InvalidRequestError(name, f"unknown field number(s) {numbers}: this server speaks "
                                      f"vllm.grpc.engine from smg-grpc-proto {_proto_version()}")
    for name in _UNSUPPORTED_REQUEST:
        if _is_set(request, name):
            raise InvalidRequestError(name, "not supported by pagedserve (no KV transfer or multimodal inputs)")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidRequestError("data_parallel_rank",
                                  f"this server has one rank (0), got {request.data_parallel_rank}")
    s = request.sampling_params
    constraint = s.WhichOneof("constraint")
    if constraint is not None:
        raise InvalidRequestError(f"{SP}.{constraint}", "structured output constraints are not supported")
    for name in _UNSUPPORTED_SAMPLING:
        if _is_set(s, name):
            raise InvalidRequestError(f"{SP}.{name}", "not supported by pagedserve")


def _is_set(message: Message, name: str) -> bool:
    field = message.DESCRIPTOR.fields_by_name[name]
    if field.is_repeated:
        return len(getattr(message, name)) > 0
    if field.has_presence:
        return message.HasField(name)
    return bool(getattr(message, name))


def _sampling_params(s: vpb.SamplingParams) -> SamplingParams:
    kwargs: dict[str, object] = {name: getattr(s, name) for name in _ZERO_IS_UNSET if getattr(s, name)}
    for name in ("temperature", "max_tokens", "seed", "logprobs"):
        if s.HasField(name):
            kwargs[name] = getattr(s, name)
    if s.HasField("logprobs") and s.logprobs == -1:
        raise InvalidRequestError(f"{SP}.logprobs", "-1 (all tokens) is not supported; ask for at most 20")
    kwargs.update(ignore_eos=s.ignore_eos, include_stop_str_in_output=s.include_stop_str_in_output)
    if s.stop:
        kwargs["stop"] = tuple(s.stop)
    if s.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(s.stop_token_ids)
    if s.logit_bias:
        kwargs["logit_bias"] = dict(s.logit_bias)
    kwargs.setdefault("max_tokens", 1 << 30)  # unset: whatever room the context leaves (_fit_context)
    with _proto_names():
        return SamplingParams(**kwargs)


def _fit_context(params: SamplingParams, s: vpb.SamplingParams, prompt_len: int, context: int) -> SamplingParams:
    room = context - prompt_len
    if params.max_tokens <= room:
        return params
    if not s.HasField("max_tokens"):
        return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
    raise InvalidRequestError(f"{SP}.max_tokens", f"{params.max_tokens} new tokens after a {prompt_len}-token "
                              f"prompt exceed the model's context of {context} tokens (at most {room})")


def _prompt_ids(request: vpb.GenerateRequest, facts: ModelFacts) -> list[int]:
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidRequestError("input", "set either tokenized or text")
    field = "tokenized.input_ids" if which == "tokenized" else "text"
    ids = list(request.tokenized.input_ids) if which == "tokenized" else facts.encode(request.text, True)
    if not ids:
        raise InvalidRequestError(field, "prompt is empty")
    for i, token in enumerate(ids):
        if token >= facts.vocab_size:
            raise InvalidRequestError(
                f"{field}[{i}]", f"token id {token} is outside the vocabulary (size {facts.vocab_size})")
    s = request.sampling_params
    if s.HasField("truncate_prompt_tokens"):
        ids = _truncate(ids, s.truncate_prompt_tokens, facts.max_context_length)
    if len(ids) >= facts.max_context_length:
        raise InvalidRequestError(field, f"prompt is {len(ids)} tokens; the model's context is "
                                  f"{facts.max_context_length} tokens and at least one must be left to generate")
    return ids


def _truncate(ids: list[int], keep: int, context: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last `keep` tokens; -1 keeps as many as the context allows."""
    if keep == -1:
        keep = context - 1
    if keep < 1:
        raise InvalidRequestError(f"{SP}.truncate_prompt_tokens", f"must be >= 1 or -1, got {keep}")
    return ids[-keep:]


@contextmanager
def _proto_names() -> Iterator[None]:
    try:
        yield
    except InvalidRequestError as exc:
        raise InvalidRequestError(_ENGINE_TO_PROTO.get(exc.field, exc.field), exc.message) from None


def _proto_version() -> str:
    from smg_grpc_proto import __version__

    return __version__
