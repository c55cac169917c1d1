"""AsyncEngine's loop thread outlives what goes wrong around it. Callers on several event loops (an application that
runs `asyncio.run` per call in worker threads, or embeds the engine beside its own loop) get outputs routed per loop,
and a loop that closes with a stream in flight costs only that stream (before, the thread died of 'Event loop is
closed' on its next delivery and every later request hung). A bug submitting one request fails that request; a bug
in the loop's own bookkeeping fails the requests in flight, and the next ones are served."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from async_engine_fixtures import final_tokens, running_async_engine, start_then_close_loop
from conftest import make_tiny_model
from pagedserve.engine import AsyncEngine, EngineConfig, SamplingParams
from pagedserve.engine.errors import PagedServeError, RequestFailedError, StepFailedError
from pagedserve.engine.loop_commands import deliver, resolve
from pagedserve.service.core.errors import to_rpc_error

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    config = EngineConfig(model=str(make_tiny_model(tmp_path_factory.mktemp("loops"))), dtype="float32")
    with running_async_engine(config) as front_and_loop:
        yield front_and_loop


async def _tokens(engine: AsyncEngine, request_id: str, prompt: str) -> tuple[int, ...]:
    return await final_tokens(engine, request_id, prompt, SHORT)


def test_a_closed_callers_loop_aborts_its_streams_and_the_engine_goes_on(front):
    engine, loop = front
    alone = loop.run_until_complete(_tokens(engine, "alone", "the sea is"))
    aborted_before = engine.engine.num_aborted_requests
    held: list = []
    doomed = threading.Thread(target=start_then_close_loop, args=(engine, "doomed", "a long answer", LONG, 2, held))
    doomed.start()
    doomed.join()
    got = loop.run_until_complete(asyncio.wait_for(_tokens(engine, "bystander", "the sea is"), 60))
    assert got == alone
    deadline = time.monotonic() + 30
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.engine.has_unfinished_requests()  # the doomed request did not run its 400 tokens
    assert engine.engine.num_aborted_requests == aborted_before + 1
    assert engine.engine.block_manager.num_used_blocks == 0 and engine.num_unfinished == 0
    assert engine._thread.is_alive()
    # The same client id is free again, and the engine still serves the loop that is alive.
    assert loop.run_until_complete(asyncio.wait_for(_tokens(engine, "doomed", "the sea is"), 60)) == alone
    held.clear()


def test_deliveries_to_a_closed_loop_are_dropped_not_raised():
    closed = asyncio.new_event_loop()
    future = closed.create_future()
    closed.close()
    assert deliver(closed, print, "never") is False
    resolve(future, 1)  # the engine thread answering a caller that is gone: no error
    assert not future.done()


async def _outcome(engine: AsyncEngine, request_id: str, prompt: str, params: SamplingParams = SHORT):
    try:
        last = None
        async for out in engine.generate(request_id, prompt, params):
            last = out
        return last.outputs[0].token_ids
    except PagedServeError as exc:
        return exc


def test_a_bug_submitting_one_request_fails_only_that_request(front, monkeypatch):
    engine, loop = front
    alone = loop.run_until_complete(_tokens(engine, "alone", "the sea is"))
    submit = engine.engine.submit

    def failing(engine_id, request, arrival_time=None):
        if request.params.max_tokens == 7:
            raise KeyError("injected")
        return submit(engine_id, request, arrival_time)

    monkeypatch.setattr(engine.engine, "submit", failing)
    victim = SamplingParams(temperature=0, max_tokens=7)

    async def both():
        return await asyncio.gather(_outcome(engine, "victim", "hello", victim), _outcome(engine, "mate", "the sea is"))

    failed, mate = loop.run_until_complete(asyncio.wait_for(both(), 60))
    assert isinstance(failed, RequestFailedError) and "submitting" in str(failed) and "KeyError" in str(failed)
    assert mate == alone
    assert engine.engine.block_manager.num_used_blocks == 0 and engine._thread.is_alive()


def test_a_bug_in_the_loops_bookkeeping_fails_the_requests_in_flight_and_serving_goes_on(front, monkeypatch):
    engine, loop = front
    alone = loop.run_until_complete(_tokens(engine, "alone", "the sea is"))
    route, calls = engine._streams.route, []

    def failing(outputs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return route(outputs)

    monkeypatch.setattr(engine._streams, "route", failing)
    failed = loop.run_until_complete(asyncio.wait_for(_outcome(engine, "in-flight", "a long answer", LONG), 60))
    assert isinstance(failed, StepFailedError) and "injected" in str(failed)
    assert loop.run_until_complete(asyncio.wait_for(_tokens(engine, "next", "the sea is"), 60)) == alone
    assert engine.engine.block_manager.num_used_blocks == 0 and engine._thread.is_alive()


def test_a_failed_step_fails_its_requests_as_retryable_and_the_next_step_serves(front, monkeypatch):
    """An exception out of the step (the forward, shared by the batch) fails the requests in it with StepFailedError,
    which the front ends send as UNAVAILABLE / HTTP 503 (a retry may succeed), not as a dead engine."""
    engine, loop = front
    alone = loop.run_until_complete(_tokens(engine, "alone", "the sea is"))
    step, steps = engine.engine.step, []

    def failing():
        steps.append(1)
        if len(steps) == 4:
            raise RuntimeError("injected forward failure")
        return step()

    monkeypatch.setattr(engine.engine, "step", failing)

    async def pair():
        return await asyncio.gather(_outcome(engine, "one", "a long answer", LONG), _outcome(engine, "two", "hi", LONG))

    outcomes = loop.run_until_complete(asyncio.wait_for(pair(), 60))
    assert all(isinstance(o, StepFailedError) and "injected forward failure" in str(o) for o in outcomes)
    assert {to_rpc_error(o).code for o in outcomes} == {grpc.StatusCode.UNAVAILABLE}
    assert engine.dead_reason is None
    assert loop.run_until_complete(asyncio.wait_for(_tokens(engine, "after", "the sea is"), 60)) == alone
    assert engine.engine.block_manager.num_used_blocks == 0 and not engine.engine.has_unfinished_requests()
