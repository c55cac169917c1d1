"""One client's request never harms another's: the cases issue 13 found, each over a real socket with a
well-formed bystander stream in the same batch that must finish with exactly its solo output."""

from __future__ import annotations

import threading

import grpc
import pytest
from service_fixtures import engine_idle, model_info, shared_server, stub, wait_until  # noqa: F401

from pagedserve.engine.request_id import MAX_REQUEST_ID_CHARS
from pagedserve.v1 import generate_pb2 as pb

BYSTANDER = pb.GenerateRequest(text="List the planets of the solar system:", sampling=pb.SamplingOptions(temperature=0),
                               stopping=pb.StoppingOptions(max_new_tokens=48, ignore_eos=True))


@pytest.fixture(scope="module")
def channel(shared_server) -> grpc.Channel:  # noqa: F811
    with grpc.insecure_channel(shared_server.target) as ch:
        yield ch


@pytest.fixture(scope="module")
def bystander_alone(channel) -> list[int]:
    return [t for f in stub(channel).Generate(BYSTANDER, timeout=300) for t in f.delta.token_ids]


class Bystander:
    """A greedy stream started first and read on a thread, so the requests under test join its batch."""

    def __init__(self, channel: grpc.Channel):
        self.call = stub(channel).Generate(BYSTANDER, timeout=300)
        self.tokens: list[int] = []
        self.first_token = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.first_token.wait(120), "the bystander produced no token"

    def _read(self) -> None:
        for frame in self.call:
            self.tokens.extend(frame.delta.token_ids)
            if self.tokens:
                self.first_token.set()

    def finish(self) -> list[int]:
        self.thread.join(300)
        assert self.call.code() == grpc.StatusCode.OK, self.call.details()
        return self.tokens


def tokens_of(call) -> list[int]:
    return [t for f in call for t in f.delta.token_ids]


def status_of(channel: grpc.Channel, request: pb.GenerateRequest, metadata=()) -> tuple[grpc.StatusCode, str]:
    try:
        tokens_of(stub(channel).Generate(request, timeout=120, metadata=metadata))
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def short(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="The capital of France is", sampling=pb.SamplingOptions(**sampling),
                              stopping=pb.StoppingOptions(max_new_tokens=8, ignore_eos=True))


@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-30])
def test_denormal_and_tiny_temperatures_sample_like_greedy_beside_a_bystander(channel, bystander_alone, temperature):
    greedy = tokens_of(stub(channel).Generate(short(temperature=0), timeout=120))
    bystander = Bystander(channel)
    tiny = tokens_of(stub(channel).Generate(short(temperature=temperature, seed=3), timeout=120))
    assert bystander.finish() == bystander_alone
    # logits / t with t -> 0 leaves all the mass on the best token (ties aside, which this prompt has none of).
    assert tiny == greedy
    wait_until(lambda: engine_idle(channel), 60, "both requests to leave the engine")


@pytest.mark.parametrize("sampling, field", [
    ({"temperature": 1.0, "repetition_penalty": 1e-45}, "sampling.repetition_penalty"),
    ({"temperature": 1.0, "repetition_penalty": 1e6}, "sampling.repetition_penalty"),
    ({"temperature": 0.5, "logit_bias": {42: 3e38}}, "sampling.logit_bias"),
    ({"temperature": 0.5, "logit_bias": {42: -1e30}}, "sampling.logit_bias"),
])
def test_out_of_range_penalties_and_biases_name_the_field_and_spare_the_bystander(
        channel, bystander_alone, sampling, field):
    bystander = Bystander(channel)
    code, details = status_of(channel, short(**sampling))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details
    assert bystander.finish() == bystander_alone


def test_largest_accepted_bias_and_penalty_sample_normally(channel, bystander_alone):
    bystander = Bystander(channel)
    forced = tokens_of(stub(channel).Generate(short(temperature=0.5, logit_bias={1234: 100.0}), timeout=120))
    penalised = tokens_of(stub(channel).Generate(short(temperature=1.0, repetition_penalty=0.01, seed=1), timeout=120))
    assert forced == [1234] * 8 and len(penalised) == 8
    assert bystander.finish() == bystander_alone


@pytest.mark.parametrize("bad_id, why", [
    ("line\nbreak", "visible ASCII"), ("nul\x00byte", "visible ASCII"), ("caf\u00e9", "visible ASCII"),
    ("with space", "visible ASCII"), ("x" * 10_000, f"at most {MAX_REQUEST_ID_CHARS}"),
])
def test_bad_request_id_field_is_invalid_argument(channel, bad_id, why):
    code, details = status_of(channel, pb.GenerateRequest(request_id=bad_id, text="hi",
                                                          stopping=pb.StoppingOptions(max_new_tokens=2)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith("request_id") and why in details


@pytest.mark.parametrize("bad_id, why", [("x" * 10_000, f"at most {MAX_REQUEST_ID_CHARS}"),
                                         ("two words", "visible ASCII")])
def test_bad_request_id_metadata_is_invalid_argument(channel, bad_id, why):
    code, details = status_of(channel, pb.GenerateRequest(text="hi", stopping=pb.StoppingOptions(max_new_tokens=2)),
                              metadata=(("x-request-id", bad_id),))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith("x-request-id") and why in details


def test_longest_valid_request_id_is_echoed(channel):
    request_id = "r" * MAX_REQUEST_ID_CHARS
    call = stub(channel).Generate(pb.GenerateRequest(request_id=request_id, text="hi",
                                                     stopping=pb.StoppingOptions(max_new_tokens=2)), timeout=120)
    frames = list(call)
    assert frames[0].started.request_id == request_id
    assert dict(call.initial_metadata())["x-request-id"] == request_id


def test_a_cancelled_id_can_be_reused_at_once(channel, bystander_alone):
    bystander = Bystander(channel)
    long = pb.GenerateRequest(request_id="retry-me", text="Write a long story about a dragon.",
                              sampling=pb.SamplingOptions(temperature=0),
                              stopping=pb.StoppingOptions(max_new_tokens=400, ignore_eos=True))
    for _ in range(10):
        call = stub(channel).Generate(long, timeout=120)
        next(iter(call))  # the request is in the engine
        call.cancel()
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        assert info.value.code() == grpc.StatusCode.CANCELLED
    again = list(stub(channel).Generate(pb.GenerateRequest(
        request_id="retry-me", text="hi", sampling=pb.SamplingOptions(temperature=0),
        stopping=pb.StoppingOptions(max_new_tokens=3, ignore_eos=True)), timeout=120))
    assert again[0].started.request_id == "retry-me"
    assert sum(len(f.delta.token_ids) for f in again) == 3
    assert bystander.finish() == bystander_alone
    wait_until(lambda: engine_idle(channel), 60, "every request to leave the engine")
    assert model_info(channel).kv_cache.used_blocks == 0
