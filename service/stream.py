"""One Generate call's engine stream: heartbeats while queued, the time limit, and abort on any early exit."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedserve.service.frames import FrameBuilder, timing
from pagedserve.service.metrics import ServiceMetrics
from pagedserve.service.requests import EngineRequest
from pagedserve.v1 import generate_pb2 as pb

log = logging.getLogger(__name__)


class _Event(enum.Enum):
    HEARTBEAT = "heartbeat"  # nothing yet and a heartbeat is due
    END = "end"  # the engine stream ended, or the time limit passed


class RequestStream:
    def __init__(self, engine: Any, engine_id: str, request_id: str, req: EngineRequest, metrics: ServiceMetrics):
        self.engine, self.engine_id, self.req, self.metrics = engine, engine_id, req, metrics
        self.builder = FrameBuilder(request_id, len(req.prompt_token_ids), req.truncated, req.params, req.stream_mode)
        self.clock = _TokenClock(req.params.n)
        self.loop = asyncio.get_running_loop()
        self.time_limit_at = None if req.time_limit_s is None else self.loop.time() + req.time_limit_s
        self.timed_out = False
        self.last: Any = None  # the latest RequestOutput
        self._pending: asyncio.Future | None = None  # an anext() on the engine stream, kept across heartbeats
        self._outputs: Any = None

    async def frames(self) -> AsyncIterator[pb.GenerateResponse]:
        self._outputs = aiter(self.engine.generate(self.engine_id, self.req.prompt_token_ids, self.req.params))
        try:
            while not self.builder.all_finished:
                event = await self._next_event()
                if event is _Event.END:
                    break
                if event is _Event.HEARTBEAT:
                    yield pb.GenerateResponse(heartbeat=pb.Heartbeat(num_waiting=self.engine.stats().num_waiting))
                    continue
                self.last = event
                frames = self.builder.frames(event)
                self.metrics.observe_token_times(self.clock.intervals(frames))
                for frame in frames:
                    yield frame
            if not self.builder.all_finished:
                for frame in await self._finish_early():
                    yield frame
            self._observe()
        finally:
            await self._release()

    async def _next_event(self) -> Any:
        if self._pending is None and self._wait_time() is None:
            # No heartbeat or time limit to watch: await the engine directly (no task and wait() per token).
            try:
                return await anext(self._outputs)
            except StopAsyncIteration:
                return _Event.END
        self._pending = self._pending or asyncio.ensure_future(anext(self._outputs))
        done, _ = await asyncio.wait({self._pending}, timeout=self._wait_time())
        if not done:
            if self.time_limit_at is not None and self.loop.time() >= self.time_limit_at:
                self.timed_out = True
                return _Event.END
            return _Event.HEARTBEAT
        pending, self._pending = self._pending, None
        try:
            return pending.result()
        except StopAsyncIteration:
            return _Event.END

    def _wait_time(self) -> float | None:
        waits = [] if self.builder.started or self.req.heartbeat_s is None else [self.req.heartbeat_s]
        if self.time_limit_at is not None:
            waits.append(self.time_limit_at - self.loop.time())
        return max(0.0, min(waits)) if waits else None

    async def _finish_early(self) -> list[pb.GenerateResponse]:
        """Time limit, or the engine ended the stream early (shutdown): every index still gets a Final."""
        await self._settle_pending()
        await self._abort()
        reason = pb.FINISH_REASON_TIME_LIMIT if self.timed_out else pb.FINISH_REASON_CANCELLED
        return self.builder.unfinished_finals(reason, self.last.metrics if self.last is not None else _Arrival())

    async def _release(self) -> None:
        await self._settle_pending()
        if not self.builder.all_finished:
            await self._abort()  # client cancel, deadline or error: free the KV blocks now
        try:
            await self._outputs.aclose()
        except (RuntimeError, StopAsyncIteration):
            pass  # already closed

    async def _settle_pending(self) -> None:
        """Cancel an in-progress anext() and wait for it, so the engine stream is idle before it is closed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.cancel()
        try:
            await pending
        except BaseException:  # noqa: BLE001 - its outcome no longer matters: cancelled, finished or failed
            pass

    async def _abort(self) -> None:
        try:
            await self.engine.abort(self.engine_id)
        except Exception:  # aborting must never mask the original outcome
            log.exception("abort of %s failed", self.engine_id)

    def _observe(self) -> None:
        if self.last is None:
            return
        reasons = [o.finish_reason for o in self.last.outputs if o.finish_reason]
        generated = sum(c.num_tokens for c in self.builder.completions)
        self.metrics.observe_request(timing(self.last.metrics), self.builder.prompt_tokens, generated,
                                     "time_limit" if self.timed_out else reasons[0] if reasons else "abort")


class _Arrival:
    """Metrics stand-in for a request that produced no output before its time limit."""

    def __init__(self) -> None:
        self.arrival_time = time.monotonic()
        self.first_scheduled_time = self.first_token_time = self.finished_time = None
        self.num_preemptions = 0


class _TokenClock:
    """Inter-token latency per completion index: the gap between deltas spread over the tokens they carry."""

    def __init__(self, n: int):
        self.last: list[float | None] = [None] * n

    def intervals(self, frames: list[pb.GenerateResponse]) -> list[float]:
        now, out = time.monotonic(), []
        for frame in frames:
            if frame.WhichOneof("frame") != "delta" or not frame.delta.token_ids:
                continue
            k, prev = len(frame.delta.token_ids), self.last[frame.index]
            if prev is not None:
                out.extend([(now - prev) / k] * k)
            self.last[frame.index] = now
        return out
