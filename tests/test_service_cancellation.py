"""Client cancellation and deadlines abort the request in the engine and return its KV blocks to the pool."""

from __future__ import annotations

import grpc
import pytest
from service_fixtures import engine_idle, model_info, shared_server, stub, wait_until  # noqa: F401

from pagedserve.v1 import generate_pb2 as pb

LONG = 400  # far more tokens than any test lets the request produce


@pytest.fixture(scope="module")
def channel(shared_server) -> grpc.Channel:  # noqa: F811
    with grpc.insecure_channel(shared_server.target) as ch:
        yield ch


def long_request(prompt: str = "Write a long story about a dragon.") -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, sampling=pb.SamplingOptions(temperature=0),
                              stopping=pb.StoppingOptions(max_new_tokens=LONG, ignore_eos=True))


def test_cancel_after_k_tokens_frees_the_requests_blocks(channel):
    wait_until(lambda: engine_idle(channel), 120, "an idle engine before the test")
    call = stub(channel).Generate(long_request(), timeout=300)
    received = 0
    for frame in call:
        received += len(frame.delta.token_ids)
        if received >= 3:
            break
    during = model_info(channel)
    assert during.scheduler.running_requests == 1
    assert during.kv_cache.used_blocks >= 1, "the running request holds KV blocks"
    call.cancel()
    wait_until(lambda: engine_idle(channel), 60, "the cancelled request to leave the engine")
    after = model_info(channel)
    assert after.kv_cache.used_blocks == 0
    assert after.kv_cache.free_blocks == after.kv_cache.total_blocks
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED


def test_deadline_shorter_than_generation_is_deadline_exceeded_and_frees_blocks(channel):
    wait_until(lambda: engine_idle(channel), 120, "an idle engine before the test")
    call = stub(channel).Generate(long_request("Count from one to a thousand:"), timeout=1.5)
    tokens = 0
    with pytest.raises(grpc.RpcError) as info:
        for frame in call:
            tokens += len(frame.delta.token_ids)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert tokens < LONG
    wait_until(lambda: engine_idle(channel), 60, "the timed-out request to leave the engine")
    assert model_info(channel).kv_cache.used_blocks == 0


def test_cancelled_request_does_not_disturb_a_concurrent_one(channel):
    """Aborting one request mid-batch must not change the other's greedy output."""
    short = pb.GenerateRequest(text="The capital of France is", sampling=pb.SamplingOptions(temperature=0),
                               stopping=pb.StoppingOptions(max_new_tokens=16, ignore_eos=True))
    alone = [t for f in stub(channel).Generate(short, timeout=120) for t in f.delta.token_ids]
    victim = stub(channel).Generate(long_request(), timeout=300)
    next(iter(victim))
    survivor = stub(channel).Generate(short, timeout=120)
    tokens = []
    for i, frame in enumerate(survivor):
        tokens.extend(frame.delta.token_ids)
        if i == 2:
            victim.cancel()
    assert tokens == alone
    wait_until(lambda: engine_idle(channel), 60, "both requests to leave the engine")
