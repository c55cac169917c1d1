"""Property-based fuzzing of the router protocol (vllm.grpc.engine.VllmEngine, as SMG and llm-d send it) over a real
socket: GenerateRequests with every sampling field legal, out of range or unsupported, token ids in and out of the
vocabulary, text prompts, request ids of any shape; sent beside a pagedserve.v1 bystander in the same batch, with
Aborts by id racing them. Raw garbage on this service's RPCs is in test_fuzz_grpc.py.

Each example checks: every request ends OK or with a documented code whose message names a request field (never
UNKNOWN/INTERNAL); a finished stream ends with one `complete` per choice; the bystander's tokens equal its solo run;
afterwards no KV block is held and the server still reports SERVING. Budget and replay: see fuzz_support.py.
"""

from __future__ import annotations

import concurrent.futures
import json

import grpc
import pytest
from constraint_strategies import CHOICES, GRAMMARS, REGEXES, SCHEMA_TEXT, STRUCTURAL_TAGS
from fuzz_support import check_outcome, fuzz_settings, run_beside_a_bystander
from hypothesis import given
from hypothesis import strategies as st
from service_fixtures import engine_idle, shared_server, stub, wait_until  # noqa: F401
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc

from pagedserve.v1 import generate_pb2 as pb

F32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
UINT32 = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))
INT32 = st.one_of(st.integers(-2, 40), st.integers(-(2**31), 2**31 - 1))


def _mostly(valid, wild):
    """Three draws in four from the legal range, so that combinations of several fields still get served."""
    return st.sampled_from([True, True, True, False]).flatmap(lambda legal: valid if legal else wild)


SAMPLING = {
    "temperature": _mostly(st.floats(0, 2), st.one_of(st.sampled_from([1e-45, -1.0]), F32)),
    "top_p": _mostly(st.floats(0.01, 1), st.one_of(st.sampled_from([0.0, 1.5]), F32)),
    "top_k": _mostly(st.integers(0, 100), UINT32),
    "min_p": _mostly(st.floats(0, 1), st.one_of(st.sampled_from([-0.1]), F32)),
    "frequency_penalty": _mostly(st.floats(-2, 2), F32),
    "presence_penalty": _mostly(st.floats(-2, 2), F32),
    "repetition_penalty": _mostly(st.floats(0.01, 100), st.one_of(st.sampled_from([1e-45, 101.0]), F32)),
    "max_tokens": _mostly(st.integers(0, 4), UINT32),
    "min_tokens": _mostly(st.integers(0, 3), UINT32),
    "stop": st.lists(st.text(max_size=40), max_size=4),
    "stop_token_ids": st.lists(_mostly(st.integers(0, 49151), UINT32), max_size=3),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "ignore_eos": st.booleans(),
    "n": _mostly(st.integers(1, 4), st.integers(0, 70)),
    "logprobs": _mostly(st.integers(0, 20), INT32),
    "prompt_logprobs": INT32,
    "seed": INT32,
    "include_stop_str_in_output": st.booleans(),
    "truncate_prompt_tokens": _mostly(st.integers(1, 600), INT32),
}
# The constraint oneof: at most one member is drawn (setting a second would replace the first).
CONSTRAINTS = {
    "json_schema": SCHEMA_TEXT,
    "regex": REGEXES,
    "grammar": GRAMMARS,
    "structural_tag": STRUCTURAL_TAGS.map(json.dumps),
    "json_object": st.booleans(),
    "choice": CHOICES.map(lambda choices: vpb.ChoiceConstraint(choices=choices)),
    "grammar_from_first_token": st.booleans(),
}
TOKEN_IDS = _mostly(st.lists(st.integers(0, 49151), min_size=1, max_size=40),
                    st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 2**32 - 1)), max_size=600))
VALID_ID = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40)
# Mostly ids a router sends; sometimes empty, non-ASCII or too long.
REQUEST_ID = st.sampled_from([True, True, True, False]).flatmap(lambda legal: VALID_ID if legal else st.one_of(
    st.just(""), st.text(max_size=20), st.text(alphabet="ab", min_size=250, max_size=300)))


@st.composite
def generate_requests(draw) -> vpb.GenerateRequest:
    request = vpb.GenerateRequest(request_id=draw(REQUEST_ID), stream=draw(st.booleans()))
    which = draw(st.sampled_from(["tokenized"] * 4 + ["text"] * 2 + ["none"]))
    # Prompts are mostly non-empty: an empty one ends the request before sampling is even read.
    if which == "tokenized":
        request.tokenized.input_ids.extend(draw(TOKEN_IDS))
    elif which == "text":
        request.text = draw(_mostly(st.text(min_size=1, max_size=80), st.text(max_size=80)))
    request.sampling_params.max_tokens = 3  # cheap unless a draw overrides it
    for name in draw(st.lists(st.sampled_from(sorted(SAMPLING)), max_size=5, unique=True)):
        value = draw(SAMPLING[name])
        field = getattr(request.sampling_params, name)
        if isinstance(value, list):
            field.extend(value)
        else:
            setattr(request.sampling_params, name, value)
    constraint = draw(st.one_of(st.none(), st.none(), st.sampled_from(sorted(CONSTRAINTS))))
    if constraint is not None:
        value = draw(CONSTRAINTS[constraint])
        if isinstance(value, vpb.ChoiceConstraint):
            request.sampling_params.choice.CopyFrom(value)
        else:
            setattr(request.sampling_params, constraint, value)
    for token, bias in draw(st.dictionaries(_mostly(st.integers(0, 49151), INT32),  # the proto map key is int32
                                            _mostly(st.floats(-100, 100), F32), max_size=2)).items():
        request.sampling_params.logit_bias[token] = bias
    if draw(st.sampled_from([False] * 9 + [True])):
        request.data_parallel_rank = draw(INT32)
    return request


REQUEST_FIELDS = {f.name for f in vpb.GenerateRequest.DESCRIPTOR.fields} | {"input", "request_id"}
BYSTANDER = pb.GenerateRequest(text="Name three colours:", sampling=pb.SamplingOptions(temperature=0),
                               stopping=pb.StoppingOptions(max_new_tokens=10, ignore_eos=True))


@pytest.fixture(scope="module")
def channel(shared_server) -> grpc.Channel:  # noqa: F811
    with grpc.insecure_channel(shared_server.target) as ch:
        yield ch


def _tokens(channel: grpc.Channel) -> list[int]:
    return [t for frame in stub(channel).Generate(BYSTANDER, timeout=300) for t in frame.delta.token_ids]


def _outcome(engine: vgrpc.VllmEngineStub, request: vpb.GenerateRequest) -> tuple[grpc.StatusCode, str, list]:
    try:
        replies = list(engine.Generate(request, timeout=120))
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", []
    return grpc.StatusCode.OK, "", replies


def _check_replies(request: vpb.GenerateRequest, replies: list[vpb.GenerateResponse]) -> None:
    completes = [r.complete for r in replies if r.WhichOneof("response") == "complete"]
    aborted = request.request_id.startswith("abort-")
    if not aborted:  # an Abort may end a stream early, with or without its completions
        n = request.sampling_params.n or 1
        assert sorted(c.index for c in completes) == list(range(n)), replies


@pytest.mark.parametrize("stream", [False, True])
def test_samples_ending_in_different_steps_complete_once_each(channel, stream):
    """Half the vocabulary stops a sample, so the 8 samples end over several steps; every engine output lists all
    of them, finished or not, and each index still gets exactly one Complete."""
    request = vpb.GenerateRequest(request_id=f"spread-{stream}", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]),
                                  stream=stream, sampling_params=vpb.SamplingParams(
                                      n=8, max_tokens=6, temperature=1.0, seed=7, stop_token_ids=range(0, 49152, 2)))
    code, details, replies = _outcome(vgrpc.VllmEngineStub(channel), request)
    assert code == grpc.StatusCode.OK, details
    completes = [r.complete for r in replies if r.WhichOneof("response") == "complete"]
    assert sorted(c.index for c in completes) == list(range(8))
    assert len({c.completion_tokens for c in completes}) > 1  # they did end in different steps


def test_fuzzed_router_requests_never_harm_a_bystander(channel):
    engine = vgrpc.VllmEngineStub(channel)
    alone = _tokens(channel)
    pool = concurrent.futures.ThreadPoolExecutor(5)

    @fuzz_settings()
    @given(st.lists(generate_requests(), min_size=1, max_size=3), st.booleans())
    def run(requests: list[vpb.GenerateRequest], abort_first: bool) -> None:
        if abort_first:  # an Abort racing the request it names, as a router does when its HTTP client leaves
            requests[0].request_id = "abort-" + requests[0].request_id[:40]
        bystander = pool.submit(_tokens, channel)
        outcomes = [pool.submit(_outcome, engine, r) for r in requests]
        if abort_first:
            engine.Abort(vpb.AbortRequest(request_ids=[requests[0].request_id]), timeout=30)
        for request, future in zip(requests, outcomes):
            code, details, replies = future.result()
            check_outcome(code, details, REQUEST_FIELDS)
            if code == grpc.StatusCode.OK:
                _check_replies(request, replies)
        assert bystander.result() == alone
        wait_until(lambda: engine_idle(channel), 60, "every fuzzed request to leave the engine")

    run_beside_a_bystander(run, pool, channel)
    assert engine.HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy
