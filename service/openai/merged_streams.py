"""Several engine streams read as one, for a request with several prompts (a /v1/completions batch)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

_END = object()


class MergedStreams:
    """(stream index, output) in arrival order. A stream's error is raised by next(); close() cancels the streams
    still running, which aborts their engine requests."""

    def __init__(self, streams: list[AsyncGenerator[Any, None]]):
        # One stream (every chat request, most completions) is read directly: a pump task and a queue between it
        # and the reader cost two task switches per streamed token.
        self._single = streams[0] if len(streams) == 1 else None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(streams) if self._single is None else 0
        self._tasks = [] if self._single is not None else [
            asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream: AsyncGenerator[Any, None]) -> None:
        try:
            async for output in stream:
                self._queue.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, who decides the reply
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, _END))

    async def next(self) -> tuple[int, Any] | None:
        """The next output, or None once every stream has ended."""
        if self._single is not None:
            try:
                return 0, await anext(self._single)
            except StopAsyncIteration:
                return None
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
        if self._single is not None:
            with contextlib.suppress(Exception):  # as gather(return_exceptions=True) below: never masks the reply's
                await self._single.aclose()  # runs the stream's `finally`: an unfinished request is aborted
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
