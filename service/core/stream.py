"""One engine request as transport-neutral events, for every front end.

Events are the engine's outputs (per sample: new token ids, new text, new logprobs, finish), a `Heartbeat` while
the request waits for its first output, and `Ended` when the stream stops before every sample finished (the time
limit passed, or the engine stopped). Each front end turns them into its own frames (service/v1/frames.py,
service/openai/openai_responses.py, service/router/vllm_replies.py). The request is aborted on any early exit,
and its latencies and token counts are observed once.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedserve.engine.admission import AdmittedRequest
from pagedserve.engine.outputs import RequestMetrics, RequestOutput
from pagedserve.service.core.engine_handle import EngineHandle
from pagedserve.service.core.metrics import ServiceMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    num_waiting: int  # requests queued in the engine


@dataclass(frozen=True, slots=True)
class Ended:
    """The stream stopped before every sample finished."""

    timed_out: bool  # the request's time limit passed; else the engine ended the stream (shutdown)
    metrics: RequestMetrics  # the latest output's, or the arrival alone when nothing came out


StreamEvent = RequestOutput | Heartbeat | Ended


@dataclass(frozen=True, slots=True)
class StreamOptions:
    heartbeat_s: float | None = None  # a Heartbeat this often until the first output
    time_limit_s: float | None = None  # Ended(timed_out=True) once this has passed


class _Wait(enum.Enum):
    HEARTBEAT = "heartbeat"  # nothing yet and a heartbeat is due
    END = "end"  # the engine stream ended, or the time limit passed


class RequestStream:
    def __init__(self, engine: EngineHandle, engine_id: str, request: AdmittedRequest, metrics: ServiceMetrics,
                 options: StreamOptions = StreamOptions()):
        self.engine, self.engine_id, self.request, self.metrics = engine, engine_id, request, metrics
        self.options = options
        self.loop = asyncio.get_running_loop()
        self.time_limit_at = None if options.time_limit_s is None else self.loop.time() + options.time_limit_s
        self.timed_out = False
        self.last: RequestOutput | None = None
        self._num_tokens: dict[int, int] = {}  # per sample index
        self._token_times: dict[int, float] = {}
        self._pending: asyncio.Future | None = None  # an anext() on the engine stream, kept across heartbeats
        self._outputs: AsyncIterator[RequestOutput] | None = None

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    async def events(self) -> AsyncIterator[StreamEvent]:
        self._outputs = aiter(self.engine.stream(self.engine_id, self.request))
        try:
            while not self.finished:
                event = await self._next()
                if event is _Wait.END:
                    break
                if event is _Wait.HEARTBEAT:
                    yield Heartbeat(self.engine.stats().num_waiting)
                    continue
                self._record(event)
                yield event
            if not self.finished:
                await self._settle_pending()
                await self._abort()
                yield Ended(self.timed_out, self.last.metrics if self.last is not None else _arrival())
        finally:
            await self._release()
            self._observe()

    async def _next(self) -> RequestOutput | _Wait:
        if self._pending is None and self._wait_time() is None:
            # No heartbeat or time limit to watch: await the engine directly (no task and wait() per token).
            try:
                return await anext(self._outputs)
            except StopAsyncIteration:
                return _Wait.END
        self._pending = self._pending or asyncio.ensure_future(anext(self._outputs))
        done, _ = await asyncio.wait({self._pending}, timeout=self._wait_time())
        if not done:
            if self.time_limit_at is not None and self.loop.time() >= self.time_limit_at:
                self.timed_out = True
                return _Wait.END
            return _Wait.HEARTBEAT
        pending, self._pending = self._pending, None
        try:
            return pending.result()
        except StopAsyncIteration:
            return _Wait.END

    def _wait_time(self) -> float | None:
        heartbeat = self.options.heartbeat_s
        waits = [] if self.last is not None or heartbeat is None else [heartbeat]
        if self.time_limit_at is not None:
            waits.append(self.time_limit_at - self.loop.time())
        return max(0.0, min(waits)) if waits else None

    def _record(self, output: RequestOutput) -> None:
        """Token counts per sample, and inter-token latency: the gap since a sample's previous output spread over
        the tokens this one carries."""
        self.last = output
        now, gaps = time.monotonic(), []
        for completion in output.outputs:
            self._num_tokens[completion.index] = completion.num_tokens
            k = len(completion.new_token_ids)
            if not k:
                continue
            previous = self._token_times.get(completion.index)
            if previous is not None:
                gaps.extend([(now - previous) / k] * k)
            self._token_times[completion.index] = now
        self.metrics.observe_token_times(gaps)

    async def _release(self) -> None:
        await self._settle_pending()
        if not self.finished:
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
        reasons = [c.finish_reason for c in self.last.outputs if c.finish_reason]
        reason = "time_limit" if self.timed_out else reasons[0] if self.finished and reasons else "abort"
        self.metrics.observe_request(self.last.metrics, len(self.request.prompt_token_ids),
                                     sum(self._num_tokens.values()), reason)


def _arrival() -> RequestMetrics:
    """Metrics of a request that produced no output before its time limit."""
    return RequestMetrics(time.monotonic(), None, None, None, 0, 0)
