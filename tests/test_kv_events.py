"""KV events: a subscriber that applies them rebuilds exactly the engine's prefix-cache contents.

A real engine (tiny random model, small KV budget so blocks get evicted) runs shared-prefix requests, some of
them aborted mid-way; the subscriber only sees the hub's stream, and its replica must equal the block manager's
set of cached hashes at the end.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from conftest import make_tiny_model
from pagedserve.engine import AsyncEngine, EngineConfig
from pagedserve.engine.kv_events import BlockRemoved, BlockStored
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.service.router.kv_events import KvEventHub, SubscriberDroppedError, apply
from service_fixtures import off_main_thread

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-kv-events"))
    # 24 blocks: far less than the workload's prefixes and suffixes, so cached blocks are evicted and reused.
    config = EngineConfig(model=str(model), dtype="float32", kv_cache_memory=24 * 8 * 1024, block_size=BLOCK,
                          max_num_seqs=6)
    return config, off_main_thread(LLMEngine, config)


def _workload(seed: int) -> list[tuple[list[int], bool]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(3 * BLOCK + 5)] for _ in range(4)]
    jobs = []
    for user in range(24):
        suffix = [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 40))]
        jobs.append((prefixes[user % 4] + suffix, user % 5 == 2))  # every fifth request is aborted early
    return jobs


async def _run(config: EngineConfig, llm: LLMEngine, hub: KvEventHub) -> tuple[dict, list]:
    engine = AsyncEngine(config, engine=llm)
    await engine.start()
    published = 0  # batches the engine thread handed the hub; the hub numbers them 1, 2, ...

    def publish(events) -> None:
        nonlocal published
        hub.publish(events)
        published += 1

    engine.publish_kv_events(publish)
    subscription = hub.subscribe()
    replica: dict[int, BlockStored] = {}
    seen: list = []
    applied = 0  # sequence number of the last batch the follower applied

    async def follow() -> None:
        nonlocal applied
        while True:
            batch = await subscription.next()
            seen.extend(batch.events)
            apply(replica, batch)
            applied = batch.sequence_number

    async def request(i: int, ids: list[int], abort: bool) -> None:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        async for out in engine.generate(f"r{i}", ids, params):
            if abort and out.outputs[0].token_ids:
                break  # leaving the stream aborts the request in the engine

    follower = asyncio.ensure_future(follow())
    jobs = _workload(0)
    for wave in range(0, len(jobs), 6):
        await asyncio.gather(*(request(wave + i, ids, abort) for i, (ids, abort) in enumerate(jobs[wave:wave + 6])))
        if wave == 6:
            assert await engine.reset_prefix_cache() > 0  # FlushCache: every cached block leaves at once
    await engine.shutdown()  # no step, so no batch, after this
    # The follower has applied the engine's last batch (the ceiling only bounds a hang).
    for _ in range(6000):
        if applied == published:
            break
        await asyncio.sleep(0.01)
    assert applied == published > 0, f"the subscriber applied batches up to {applied} of {published}"
    follower.cancel()
    subscription.close()
    return replica, seen


def test_subscriber_rebuilds_the_exact_cached_block_set(tiny_engine):
    config, llm = tiny_engine
    hub = KvEventHub()
    replica, seen = off_main_thread(asyncio.run, _run(config, llm, hub))
    cached = llm.block_manager.cached_hashes
    assert any(isinstance(e, BlockRemoved) for e in seen), "the workload must evict cached blocks"
    assert llm.stats().num_aborted_requests > 0
    assert llm.stats().prefix_cache_hits > 0
    assert set(replica) == set(cached) == hub.cached_hashes()
    for stored in replica.values():  # token ids and chain keys match what the engine holds
        block = llm.block_manager.blocks[llm.block_manager._cached[stored.block_hash]]
        assert block.tokens == stored.token_ids and len(stored.token_ids) == stored.block_size == BLOCK


def test_a_late_subscriber_starts_from_a_snapshot():
    hub = KvEventHub()
    hub.publish([BlockStored(1, None, (1,) * BLOCK, BLOCK), BlockStored(2, 1, (2,) * BLOCK, BLOCK)])
    hub.publish([BlockRemoved(1)])

    async def late() -> dict:
        subscription = hub.subscribe()
        replica: dict = {3: None}  # stale state from an earlier connection is replaced by the snapshot
        apply(replica, await subscription.next())
        return replica

    assert set(asyncio.run(late())) == {2}


def test_a_slow_subscriber_is_dropped_and_never_blocks_the_publisher():
    async def slow() -> str:
        hub = KvEventHub(max_pending=4)
        subscription = hub.subscribe()
        for i in range(10):  # the engine keeps publishing; nobody reads
            hub.publish([BlockStored(i, None, (i,) * BLOCK, BLOCK)])
        await asyncio.sleep(0)  # offers land on this loop
        with pytest.raises(SubscriberDroppedError) as err:
            while True:
                await subscription.next()
        fresh = hub.subscribe()  # resubscribing gives the full state again
        snapshot = await fresh.next()
        assert snapshot.snapshot and {e.block_hash for e in snapshot.events} == set(range(10))
        return str(err.value)

    assert "fell 4 batches behind" in asyncio.run(slow())


def test_a_reset_its_caller_cancelled_leaves_no_error_on_the_callers_loop(tiny_engine):
    """A client that stops waiting for reset_prefix_cache cancels its future; the engine thread's answer then finds
    it done and is dropped, instead of raising InvalidStateError in a callback on the caller's loop."""
    config, llm = tiny_engine

    async def run() -> tuple[list[dict], int]:
        errors: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        engine = AsyncEngine(config, engine=llm)
        await engine.start()
        try:
            for i in range(40):
                waiting = asyncio.ensure_future(engine.reset_prefix_cache())
                await asyncio.sleep(0)  # the command is on its way to the engine thread
                if i % 2:
                    await asyncio.sleep(0.0005 * (i % 5))  # cancelled before, while or after it answers
                waiting.cancel()
            dropped = await engine.reset_prefix_cache()  # the loop goes on serving resets
            await asyncio.sleep(0.05)  # every answer scheduled on this loop has run
        finally:
            await engine.shutdown()
        return errors, dropped

    errors, dropped = off_main_thread(asyncio.run, run())
    assert errors == [] and dropped == 0
