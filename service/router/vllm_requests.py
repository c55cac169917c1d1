"""vllm.grpc.engine GenerateRequest -> the engine's GenerationRequest, admitted once (engine/admission.py).

Field mapping only: value checks stay in SamplingParams and prompt/context checks in the admission; their errors
are renamed to the vLLM proto path the router set. Every field the engine cannot honour is refused by name when it
is set, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from google.protobuf import unknown_fields
from google.protobuf.message import Message
from pagedserve.engine.constraint import OutputConstraint, from_oneof
from pagedserve.engine.errors import InvalidRequestError, field_map, renamed
from pagedserve.engine.requests import AdmittedRequest, GenerationRequest, Prompt, TextPrompt, TokensPrompt
from pagedserve.engine.sampling_params import SamplingParams
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

SP = "sampling_params"
# Admission and SamplingParams field -> the vLLM proto field path.
_PROTO_FIELDS = field_map({
    **{name: f"{SP}.{name}" for name in (
        "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "seed", "logit_bias", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logprobs", "prompt_logprobs",
        "truncate_prompt_tokens")},
    "prompt": "text", "prompt_token_ids": "tokenized.input_ids"})
# proto3 scalars without presence: 0 means "not set" (what vLLM's own servicer assumes too).
_ZERO_IS_UNSET = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "n",
                  "min_tokens")
_UNSUPPORTED_REQUEST = ("kv_transfer_params", "mm_inputs", "extra_mm_inputs", "kv_transfer_params_json",
                        "media_refs")


def constrained_decoding_start(reasoning_parser: str, in_reasoning: bool) -> str:
    """Where the engine starts a request's constraint (GetServerInfo's constrained_decoding_start): behind a reasoning
    parser, once the thought has closed (engine/reasoning.py), unless constraints apply in the thought; else at the
    first generated token."""
    return "after_reasoning" if reasoning_parser and not in_reasoning else "first_token"


def admit(request: vpb.GenerateRequest, engine_admit: Callable[[GenerationRequest], AdmittedRequest]
          ) -> AdmittedRequest:
    _refuse_unsupported(request)
    s = request.sampling_params
    with renamed(_proto_field):
        truncate = s.truncate_prompt_tokens if s.HasField("truncate_prompt_tokens") else None
        # An unset max_tokens means "until the context is full", as in vLLM.
        return engine_admit(GenerationRequest(_prompt(request), _sampling_params(s), truncate_prompt_tokens=truncate,
                                              grammar_from_first_token=s.grammar_from_first_token))


def _proto_field(field: str) -> str:
    # The engine's `constraint.<kind>` is the oneof member `sampling_params.<kind>` (choice: its list's path).
    if field.startswith("constraint.choice"):
        return f"{SP}.choice.choices" + field[len("constraint.choice"):]
    if field.startswith("constraint."):
        return f"{SP}.{field[len('constraint.'):]}"
    return _PROTO_FIELDS(field)


def input_chars(request: vpb.GenerateRequest) -> int:
    """How much text admission will tokenize (long prompts are admitted off the event loop)."""
    return len(request.text) if request.WhichOneof("input") == "text" else 0


def _prompt(request: vpb.GenerateRequest) -> Prompt:
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidRequestError("input", "set either tokenized or text")
    if which == "tokenized":
        return TokensPrompt(tuple(request.tokenized.input_ids))
    return TextPrompt(request.text)


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


def _is_set(message: Message, name: str) -> bool:
    field = message.DESCRIPTOR.fields_by_name[name]
    if field.is_repeated:
        return len(getattr(message, name)) > 0
    if field.has_presence:
        return message.HasField(name)
    return bool(getattr(message, name))


def _sampling_params(s: vpb.SamplingParams) -> SamplingParams:
    kwargs: dict[str, object] = {name: getattr(s, name) for name in _ZERO_IS_UNSET if getattr(s, name)}
    for name in ("temperature", "max_tokens", "seed", "logprobs", "prompt_logprobs"):
        if s.HasField(name):
            kwargs[name] = getattr(s, name)
    for name in ("logprobs", "prompt_logprobs"):
        if s.HasField(name) and getattr(s, name) == -1:
            raise InvalidRequestError(f"{SP}.{name}", "-1 (all tokens) is not supported; ask for at most 20")
    kwargs.update(ignore_eos=s.ignore_eos, include_stop_str_in_output=s.include_stop_str_in_output)
    if s.stop:
        kwargs["stop"] = tuple(s.stop)
    if s.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(s.stop_token_ids)
    if s.logit_bias:
        kwargs["logit_bias"] = dict(s.logit_bias)
    kwargs.setdefault("max_tokens", None)  # unset: whatever room the context leaves
    constraint = _constraint(s)
    if constraint is not None:
        kwargs["constraint"] = constraint
    return SamplingParams(**kwargs)


def _constraint(s: vpb.SamplingParams) -> OutputConstraint | None:
    """The oneof's members are the engine's kinds by name; json_object false is no constraint, as in vLLM."""
    which = s.WhichOneof("constraint")
    if which is None or (which == "json_object" and not s.json_object):
        return None
    return from_oneof(s, which)


def _proto_version() -> str:
    from smg_grpc_proto import __version__

    return __version__
