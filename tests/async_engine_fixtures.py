"""What the in-process AsyncEngine suites share (test_engine_loop_thread.py, test_fuzz_engine_api.py): an engine
started on a private event loop, which the tests drive with loop.run_until_complete, then shut down."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from pagedserve.engine import AsyncEngine, EngineConfig


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
