"""What the in-process AsyncEngine suites share (test_engine_loop_thread.py, test_fuzz_engine_api.py): an engine
started on a private event loop, which the tests drive with loop.run_until_complete, then shut down; a stream's
final tokens; a caller whose own event loop closes with its stream in flight."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from pagedserve.engine import AsyncEngine, EngineConfig, SamplingParams


@contextlib.contextmanager
def running_async_engine(config: EngineConfig) -> Iterator[tuple[AsyncEngine, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    engine = AsyncEngine(config)
    loop.run_until_complete(engine.start())
    try:
        yield engine, loop
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()


async def final_tokens(engine: AsyncEngine, request_id: str, prompt: str, params: SamplingParams) -> tuple[int, ...]:
    last = None
    async for out in engine.generate(request_id, prompt, params):
        last = out
    return last.outputs[0].token_ids


def start_then_close_loop(engine: AsyncEngine, request_id: str, prompt: str, params: SamplingParams, reads: int,
                          held: list) -> None:
    """For a thread of its own: a stream started on a fresh loop, `reads` outputs read, then the loop closed with
    the stream suspended (its generator is kept alive in `held`, so no abort is ever sent for it)."""
    loop = asyncio.new_event_loop()

    async def start():
        stream = engine.generate(request_id, prompt, params)
        for _ in range(reads):
            await stream.__anext__()
        return stream

    try:
        held.append(loop.run_until_complete(start()))
    finally:
        loop.close()
