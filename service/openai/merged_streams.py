"""Several engine streams read as one, for a request with several prompts (a /v1/completions batch)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

_END = object()


class MergedStreams:
    """(stream index, output) in arrival order. A stream's error is raised by next(); close() cancels the streams
    still running, which aborts their engine requests."""

    def __init__(self, streams: list[AsyncIterator[Any]]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(streams)
        self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for output in stream:
                self._queue.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, who decides the reply
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, _END))

    async def next(self) -> tuple[int, Any] | None:
        """The next output, or None once every stream has ended."""
        while self._open:
            index, item = await self._queue.get()
            if item is _END:
                self._open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return index, item
        return None

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
