"""Property-based fuzzing of pagedserve.v1 over a real socket: every GenerateRequest field, legal or not, sent
beside a well-formed bystander in the same batch; and raw garbage bytes on every RPC the server registers.

Each example checks: every fuzzed request ends OK or with a documented code whose message names the field
(never UNKNOWN/INTERNAL); the bystander's tokens equal its solo run; afterwards no KV block is held and the
server still reports SERVING. Budget and replay: see fuzz_support.py.
"""

from __future__ import annotations

import concurrent.futures
import json

import grpc
import pytest
from constraint_strategies import CHOICES, GRAMMARS, REGEXES, SCHEMA_TEXT, STRUCTURAL_TAGS
from fuzz_support import check_outcome, fuzz_settings, run_beside_a_bystander
from grpc_health.v1 import health_pb2
from hypothesis import given
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from service_fixtures import engine_idle, health, shared_server, stub, wait_until  # noqa: F401

from pagedserve.v1 import generate_pb2 as pb

VLLM_ENGINE = vpb.DESCRIPTOR.services_by_name["VllmEngine"]

F32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
# Mostly near the interesting ranges, sometimes anything a float32 can hold.
TEMPERATURE = st.one_of(st.sampled_from([0.0, 1e-45, 1e-38, 0.7, 1.0, 2.0, -0.0, -1.0]), F32)
PROBABILITY = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 1.5, -0.1]), F32)
PENALTY = st.one_of(st.sampled_from([1e-45, 0.01, 1.0, 2.0, 100.0, 1e6, -2.0]), F32)
UINT32 = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))
TEXT = st.text(max_size=80)
REQUEST_ID = st.one_of(st.just(""), st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40),
                       st.text(max_size=20), st.text(alphabet="ab", min_size=250, max_size=300))
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 2**32 - 1)), max_size=600)
ROLE = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard", ""]), st.text(max_size=8))
# Templates that render, refuse, fail to parse, or read what is not there; plus arbitrary text.
CHAT_TEMPLATE = st.one_of(st.sampled_from([
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", "{{ raise_exception('no') }}", "{% for %}",
    "{{ messages[99].content }}", "{{ messages.__class__ }}", ""]), st.text(max_size=60))
SMALL_MAX_TOKENS = st.one_of(st.none(), st.integers(0, 6), st.integers(0, 2**32 - 1))


def _optional(strategy):
    return st.one_of(st.none(), strategy)


V1_CONSTRAINTS = st.one_of(
    SCHEMA_TEXT.map(lambda spec: pb.Constraint(json_schema=spec)), st.just(pb.Constraint(json_object=pb.JsonObject())),
    REGEXES.map(lambda spec: pb.Constraint(regex=spec)), GRAMMARS.map(lambda spec: pb.Constraint(grammar=spec)),
    CHOICES.map(lambda choices: pb.Constraint(choice=pb.Choices(choices=choices))),
    STRUCTURAL_TAGS.map(lambda tag: pb.Constraint(structural_tag=json.dumps(tag))), st.just(pb.Constraint()))


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=draw(REQUEST_ID))
    which = draw(st.sampled_from(["text", "token_ids", "chat", "none"]))
    if which == "text":
        request.text = draw(TEXT)
    elif which == "token_ids":
        request.token_ids.ids.extend(draw(TOKEN_IDS))
    elif which == "chat":
        for role, content in draw(st.lists(st.tuples(ROLE, TEXT), max_size=6)):
            request.chat.messages.add(role=role, content=content)
        _set_optionals(request.chat, draw, {"chat_template": CHAT_TEMPLATE, "add_generation_prompt": st.booleans()})
    _set_optionals(request, draw, {
        "add_special_tokens": st.booleans(), "truncate_input_tokens": UINT32, "n": st.integers(0, 70)})
    _set_optionals(request.sampling, draw, {
        "temperature": TEMPERATURE, "top_p": PROBABILITY, "top_k": st.integers(-(2**31), 2**31 - 1),
        "min_p": PROBABILITY, "repetition_penalty": PENALTY, "presence_penalty": PENALTY,
        "frequency_penalty": PENALTY, "seed": st.integers(0, 2**64 - 1)})
    for token, bias in draw(st.dictionaries(UINT32, F32, max_size=3)).items():
        request.sampling.logit_bias[token] = bias
    max_tokens = draw(SMALL_MAX_TOKENS)
    if max_tokens is not None:
        request.stopping.max_new_tokens = max_tokens
    else:
        request.stopping.max_new_tokens = 4  # an unset max would run 16 tokens: keep examples cheap
    _set_optionals(request.stopping, draw, {
        "min_new_tokens": UINT32, "ignore_eos": st.booleans(), "include_stop_sequence": st.booleans(),
        "time_limit_ms": UINT32})
    request.stopping.stop_sequences.extend(draw(st.lists(st.text(max_size=300), max_size=18)))
    request.stopping.stop_token_ids.extend(draw(st.lists(UINT32, max_size=4)))
    _set_optionals(request.response, draw, {
        "logprobs": st.integers(0, 30), "heartbeat_ms": UINT32})
    request.response.stream_mode = draw(st.sampled_from([0, 1, 2, 3, 2**31 - 1]))
    constraint = draw(st.one_of(st.none(), st.none(), V1_CONSTRAINTS))
    if constraint is not None:
        request.constraint.CopyFrom(constraint)
    return request


def _set_optionals(message, draw, strategies: dict) -> None:
    for name, strategy in strategies.items():
        value = draw(_optional(strategy))
        if value is not None:
            setattr(message, name, value)


REQUEST_FIELDS = ({f.name for f in pb.GenerateRequest.DESCRIPTOR.fields} | set(pb.GenerateRequest.DESCRIPTOR.oneofs_by_name)
                  | {"x-request-id", "request"})
BYSTANDER = pb.GenerateRequest(text="Name three colours:", sampling=pb.SamplingOptions(temperature=0),
                               stopping=pb.StoppingOptions(max_new_tokens=10, ignore_eos=True))


@pytest.fixture(scope="module")
def channel(shared_server) -> grpc.Channel:  # noqa: F811
    with grpc.insecure_channel(shared_server.target) as ch:
        yield ch


@pytest.fixture(scope="module")
def bystander_alone(channel) -> list[int]:
    return _tokens(stub(channel).Generate(BYSTANDER, timeout=300))


def _tokens(call) -> list[int]:
    return [t for frame in call for t in frame.delta.token_ids]


def _outcome(channel: grpc.Channel, request: pb.GenerateRequest) -> tuple[grpc.StatusCode, str, list]:
    try:
        frames = list(stub(channel).Generate(request, timeout=120))
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", []
    return grpc.StatusCode.OK, "", frames


def _check_frames(request: pb.GenerateRequest, frames: list[pb.GenerateResponse]) -> None:
    """A successful stream: Started first, then one Final per completion index."""
    kinds = [f.WhichOneof("frame") for f in frames]
    assert "started" in kinds and kinds[-1] == "final", kinds
    n = request.n if request.HasField("n") else 1
    assert sorted(f.index for f in frames if f.WhichOneof("frame") == "final") == list(range(n))


def test_fuzzed_generate_requests_never_harm_a_bystander(channel, bystander_alone):
    pool = concurrent.futures.ThreadPoolExecutor(4)

    @fuzz_settings()
    @given(st.lists(generate_requests(), min_size=1, max_size=3))
    def run(requests: list[pb.GenerateRequest]) -> None:
        bystander = pool.submit(lambda: _tokens(stub(channel).Generate(BYSTANDER, timeout=300)))
        outcomes = list(pool.map(lambda r: _outcome(channel, r), requests))
        for request, (code, details, frames) in zip(requests, outcomes):
            check_outcome(code, details, REQUEST_FIELDS)
            if code == grpc.StatusCode.OK:
                _check_frames(request, frames)
        assert bystander.result() == bystander_alone
        wait_until(lambda: engine_idle(channel), 60, "every fuzzed request to leave the engine")

    run_beside_a_bystander(run, pool, channel)


# Every RPC the server registers, with its cardinality; garbage must never take the server down.
RPCS = [
    ("/pagedserve.v1.GenerationService/Generate", "unary_stream"),
    ("/pagedserve.v1.GenerationService/Tokenize", "unary_unary"),
    ("/pagedserve.v1.GenerationService/ModelInfo", "unary_unary"),
    ("/pagedserve.v1.GenerationService/Embed", "unary_unary"),
    ("/pagedserve.v1.GenerationService/Rerank", "unary_unary"),
    ("/grpc.health.v1.Health/Check", "unary_unary"),
    ("/grpc.health.v1.Health/Watch", "unary_stream"),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "stream_stream"),
    ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", "stream_stream"),
    *[(f"/vllm.grpc.engine.VllmEngine/{m.name}", "unary_stream" if m.server_streaming else "unary_unary")
      for m in VLLM_ENGINE.methods],
]


# RPCs that may legitimately run until the client's deadline on a request that parses: a Generate asking for many
# tokens, Watch streaming health changes, SubscribeKvEvents streaming cache events until the client leaves.
# Everything else (every unary RPC, GetTokenizer, reflection) must answer garbage promptly: UNARY_CEILING_S only
# bounds a hang on a loaded host, and DEADLINE_EXCEEDED from them fails the test.
LONG_RUNNING = {"/pagedserve.v1.GenerationService/Generate", "/grpc.health.v1.Health/Watch",
                "/vllm.grpc.engine.VllmEngine/Generate", "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents"}
LONG_RUNNING_DEADLINE_S, UNARY_CEILING_S = 3, 60
# The router protocol RPCs pagedserve does not serve (service/router/vllm_servicer.py) say UNIMPLEMENTED to anything.
UNIMPLEMENTED = {f"/vllm.grpc.engine.VllmEngine/{m}" for m in ("StartProfile", "StopProfile")}
# Embeddings and reranking on this (generation) server: a request that parses is UNIMPLEMENTED (docs/embeddings.md).
EMBED = {"/vllm.grpc.engine.VllmEngine/Embed", "/pagedserve.v1.GenerationService/Embed",
         "/pagedserve.v1.GenerationService/Rerank"}


def expected_codes(method: str) -> set[grpc.StatusCode]:
    """The documented answers to bytes that may or may not parse as the RPC's request."""
    if method in UNIMPLEMENTED:
        return {grpc.StatusCode.UNIMPLEMENTED}
    codes = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
    if method in EMBED:
        return {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED}
    if method == "/grpc.health.v1.Health/Check":
        codes.add(grpc.StatusCode.NOT_FOUND)  # a service name that parses but is not served
    if method in LONG_RUNNING:
        codes |= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    if method == "/grpc.health.v1.Health/Watch":
        codes.add(grpc.StatusCode.NOT_FOUND)
    return codes


def _call_raw(channel: grpc.Channel, method: str, kind: str, payload: bytes) -> grpc.StatusCode:
    callable_ = getattr(channel, kind)(method, request_serializer=None, response_deserializer=None)
    timeout = LONG_RUNNING_DEADLINE_S if method in LONG_RUNNING else UNARY_CEILING_S
    try:
        if kind == "unary_unary":
            callable_(payload, timeout=timeout)
        elif kind == "unary_stream":
            for _ in callable_(payload, timeout=timeout):
                pass
        else:
            for _ in callable_(iter([payload]), timeout=timeout):
                pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method, kind", RPCS, ids=[m.rsplit("/", 2)[-2].rsplit(".", 1)[-1] + "." + m.rsplit("/", 1)[-1]
                                                    for m, _ in RPCS])
def test_raw_garbage_on_every_rpc(channel, method, kind):
    """Every service parses raw bytes itself (service/core/standard_services.py for health and reflection): garbage gets
    its documented answer, and only the long-running RPCs may run into the client's deadline."""
    allowed = expected_codes(method)

    @fuzz_settings()
    @given(st.binary(max_size=512))
    def run(payload: bytes) -> None:
        code = _call_raw(channel, method, kind, payload)
        assert code in allowed, (code, payload)

    run()
    wait_until(lambda: engine_idle(channel), 60, "garbage requests to leave the engine")
    assert health(channel) == health_pb2.HealthCheckResponse.SERVING
