"""AsyncEngine's own API under fuzzed use, as an application embedding the engine drives it: streams started with
valid and invalid sampling parameters (client ids drawn from a small pool, so ids collide), left after a random
number of outputs, aborted by id, the prefix cache reset, and callers whose event loop closes mid-stream, all at
once beside a bystander stream, in a KV cache small enough to preempt. Whatever the mix: every action ends with
its outputs (n of them, each within max_tokens, whether it finished, was aborted or was preempted) or an
InvalidRequestError naming its bad field (never another exception, never a hang), the bystander gets its solo
tokens, and afterwards the engine is idle with every KV block free and its loop thread alive."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from async_engine_fixtures import final_tokens, running_async_engine, start_then_close_loop
from conftest import make_tiny_model
from fuzz_support import campaign_timeout_s, fuzz_settings
from pagedserve.engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from pagedserve.engine.errors import InvalidRequestError

pytestmark = pytest.mark.timeout(campaign_timeout_s(600))

BYSTANDER = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
CLOSED_LOOP_PARAMS = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
PROMPTS = ["the sea is", "once upon a time, in a small village by the river, there lived", "1, 2, 3,", "hi"]
CLIENT_IDS = ("a", "b", "c", "d")
_examples = itertools.count()


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    model = str(make_tiny_model(tmp_path_factory.mktemp("fuzz-api")))
    block_bytes = LLM(model, dtype="float32", kv_cache_memory=1 << 20).engine.runner.kv_spec.bytes_per_block
    # 14 blocks of 16 tokens: a few long streams beside the bystander outgrow them and are preempted.
    config = EngineConfig(model=model, dtype="float32", kv_cache_memory=14 * block_bytes, block_size=16,
                          max_num_batched_tokens=48)
    with running_async_engine(config) as front_and_loop:
        yield front_and_loop


def _consistent(kwargs: dict) -> dict:
    """Valid together: n > 1 samples need a temperature, min_tokens at most max_tokens."""
    if kwargs["temperature"] <= 0:
        kwargs["n"] = 1
    kwargs["min_tokens"] = min(kwargs.get("min_tokens", 0), kwargs["max_tokens"])
    return kwargs


VALID = st.fixed_dictionaries({
    "temperature": st.sampled_from([0.0, 0.7, 1.5]),
    "max_tokens": st.sampled_from([1, 5, 40, 120]),
    "n": st.sampled_from([1, 2, 3]),
}, optional={
    "top_p": st.sampled_from([0.5, 1.0]),
    "top_k": st.sampled_from([1, 20, 0]),
    "seed": st.integers(0, 2**31),
    "stop": st.lists(st.sampled_from(["the", "\n", "zz"]), max_size=2),
    "logprobs": st.sampled_from([0, 2]),
    "min_tokens": st.sampled_from([0, 3]),
    "presence_penalty": st.sampled_from([0.0, 1.5]),
    "ignore_eos": st.booleans(),
}).map(_consistent)


# One field the engine must refuse by name (at construction or at admission: the context is 512 tokens).
BAD_FIELD = st.sampled_from([("temperature", -1.0), ("max_tokens", 10**6), ("n", 0), ("top_p", 0.0), ("top_k", -5),
                             ("logprobs", 10**6), ("min_tokens", 500), ("presence_penalty", 9.0), ("stop", [""])])
# (sampling kwargs, the field they get wrong or None): one stream in four is refused.
SAMPLING = st.one_of(*[VALID.map(lambda kwargs: (kwargs, None))] * 3,
                     st.tuples(VALID, BAD_FIELD).map(lambda vb: _with_bad(vb[0], *vb[1])))


def _with_bad(kwargs: dict, field: str, value) -> tuple[dict, str]:
    """`kwargs` with one field wrong, and that field (one sample: a wrong temperature is then the only error)."""
    return {**kwargs, "n": 1, field: value}, field


STREAM = st.tuples(st.just("stream"), st.sampled_from(CLIENT_IDS), st.sampled_from(PROMPTS), SAMPLING,
                   st.none() | st.integers(1, 6))
ABORT = st.tuples(st.just("abort"), st.sampled_from(CLIENT_IDS))
RESET = st.tuples(st.just("reset"))
CLOSED_LOOP = st.tuples(st.just("closed_loop"), st.sampled_from(PROMPTS))
# Every example runs one to five streams, with up to three other actions among them in any order.
ACTIONS = st.tuples(st.lists(STREAM, min_size=1, max_size=5), st.lists(st.one_of(ABORT, RESET, CLOSED_LOOP), max_size=3)
                    ).flatmap(lambda parts: st.permutations(parts[0] + parts[1]))


async def _tokens(engine: AsyncEngine, request_id: str, prompt: str) -> tuple[int, ...]:
    return await final_tokens(engine, request_id, prompt, BYSTANDER)


async def _stream(engine: AsyncEngine, rid: str, prompt: str, sampling: tuple[dict, str | None],
                  leave_after: int | None) -> None:
    kwargs, bad = sampling
    params = SamplingParams(**kwargs)
    assert bad is None or bad == "max_tokens", f"{bad} was accepted"  # max_tokens is refused at admission
    async with contextlib.aclosing(engine.generate(rid, prompt, params)) as outputs:
        count = 0
        async for out in outputs:
            count += 1
            if out.finished:
                assert len(out.outputs) == params.n
                assert all(len(c.token_ids) <= params.max_tokens for c in out.outputs)
            if leave_after is not None and count >= leave_after:
                return


async def _act(engine: AsyncEngine, example: int, action: tuple, held: list) -> None:
    kind = action[0]
    if kind == "stream":
        _, client, prompt, sampling, leave_after = action
        await _stream(engine, f"{client}-{example}", prompt, sampling, leave_after)
    elif kind == "abort":
        await engine.abort(f"{action[1]}-{example}")
    elif kind == "reset":
        assert await engine.reset_prefix_cache() >= 0
    else:
        rid = f"closed-{example}-{id(action)}"
        await asyncio.to_thread(start_then_close_loop, engine, rid, action[1], CLOSED_LOOP_PARAMS, 1, held)


def _check_outcome(action: tuple, outcome: BaseException | None) -> None:
    """A bad field is refused by its name; otherwise the only refusal is a client id still in flight (ids collide)."""
    bad = action[3][1] if action[0] == "stream" else None
    if bad is not None:
        assert isinstance(outcome, InvalidRequestError) and outcome.field == bad, (action, repr(outcome))
    else:
        assert outcome is None or isinstance(outcome, InvalidRequestError) and outcome.field == "request_id", \
            (action, repr(outcome))


def _settled(engine: AsyncEngine) -> bool:
    return not engine.engine.has_unfinished_requests() and engine.num_unfinished == 0


def test_fuzzed_engine_api_use_never_harms_a_bystander(front):
    engine, loop = front
    alone = loop.run_until_complete(_tokens(engine, "alone", PROMPTS[0]))

    @fuzz_settings()
    @given(ACTIONS)
    def run(actions: list[tuple]) -> None:
        example, held = next(_examples), []

        async def scenario():
            bystander = asyncio.ensure_future(_tokens(engine, f"bystander-{example}", PROMPTS[0]))
            acts = [asyncio.ensure_future(_act(engine, example, a, held)) for a in actions]
            return await asyncio.wait_for(asyncio.gather(bystander, *acts, return_exceptions=True), 300)

        got, *outcomes = loop.run_until_complete(scenario())
        assert got == alone, got
        for action, outcome in zip(actions, outcomes):
            _check_outcome(action, outcome)
        deadline = time.monotonic() + 60
        while not _settled(engine) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _settled(engine), "requests left in the engine after every stream ended"
        assert engine.engine.block_manager.num_used_blocks == 0
        assert engine._thread.is_alive() and engine.dead_reason is None
        held.clear()

    run()
    assert threading.active_count() < 50  # closed-loop callers' threads all ended
