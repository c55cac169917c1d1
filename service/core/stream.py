"""One engine request as transport-neutral events, for every front end.

Events are the engine's outputs (per sample: new token ids, new text, new logprobs, finish), a `Heartbeat` while
the request waits for its first output, and `Ended` when the stream stops before every sample finished (the time
limit passed, or the engine stopped). Each front end turns them into its own frames (service/v1/frames.py,
service/openai/openai_responses.py, service/router/vllm_replies.py). The request is aborted on any early exit,
and its latencies and token counts are reported once (service/core/telemetry.py: metrics, span, log lines).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedserve.engine.errors import RequestFailedError, StepFailedError
from pagedserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.engine.requests import AdmittedRequest
from pagedserve.service.core.engine_handle import EngineHandle
from pagedserve.service.core.telemetry import RequestEnd, RequestOrigin, Telemetry, Watch

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
    """origin: who sent the request (front end, id, trace context), for the span and log lines."""

    def __init__(self, engine: EngineHandle, engine_id: str, request: AdmittedRequest, telemetry: Telemetry,
                 options: StreamOptions = StreamOptions(), origin: RequestOrigin | None = None):
        self.engine, self.engine_id, self.request = engine, engine_id, request
        self.telemetry, self.metrics, self.origin = telemetry, telemetry.metrics, origin
        self.options = options
        self.failed = False
        self.engine_failed = False  # the engine ended this request with an error (its own or its step's)
        self.loop = asyncio.get_running_loop()
        self.time_limit_at = None if options.time_limit_s is None else self.loop.time() + options.time_limit_s
        self.timed_out = False
        self.last: RequestOutput | None = None
        self._completions: dict[int, CompletionOutput] = {}  # each sample's latest output, by index
        self._token_times: dict[int, float] = {}
        self._pending: asyncio.Future | None = None  # an anext() on the engine stream, kept across heartbeats
        self._outputs: AsyncIterator[RequestOutput] | None = None

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    async def events(self) -> AsyncIterator[StreamEvent]:
        self._arrival = time.monotonic()
        watch = self.telemetry.admitted(self.origin, self.engine_id, self.request, self._arrival)
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
                await self._abort()
                yield Ended(self.timed_out, self.last.metrics if self.last is not None else self._no_output())
        except Exception as error:
            self.failed = True
            self.engine_failed = isinstance(error, (RequestFailedError, StepFailedError))
            raise
        finally:
            await self._release()
            self._observe(watch)

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
            self._completions[completion.index] = completion
            k = len(completion.new_token_ids)
            if not k:
                continue
            previous = self._token_times.get(completion.index)
            if previous is not None:
                gaps.extend([(now - previous) / k] * k)
            self._token_times[completion.index] = now
        self.metrics.observe_token_times(gaps)

    async def _release(self) -> None:
        await self._abort()  # client cancel, deadline or error: free the KV blocks now (no-op once finished)

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
        """Closes this request's engine stream, which aborts its own registration and nothing else (the stream's
        `finally`). Never an abort by id: when the engine refused the id as still in flight, the id belongs to
        another request (a router's retry racing its original), and aborting it would end that one."""
        await self._settle_pending()
        try:
            await self._outputs.aclose()
        except (RuntimeError, StopAsyncIteration):
            pass  # already closed
        except Exception:  # aborting must never mask the original outcome
            log.exception("abort of %s failed", self.engine_id)

    def _observe(self, watch: Watch | None) -> None:
        if self.last is None and watch is None and not self.engine_failed:
            return  # nothing to report: metrics count only requests the engine answered or failed
        reasons = [c.finish_reason for c in self.last.outputs if c.finish_reason] if self.last is not None else []
        reason = ("time_limit" if self.timed_out else reasons[0] if self.finished and reasons
                  else "error" if self.failed else "abort")
        end = RequestEnd(self.last.metrics if self.last is not None else self._no_output(),
                         len(self.request.prompt_token_ids), sum(c.num_tokens for c in self._completions.values()),
                         reason, tuple(self._completions.values()))
        self.telemetry.finished(watch, end, engine_answered=self.last is not None, engine_failed=self.engine_failed)

    def _no_output(self) -> RequestMetrics:
        """Metrics of a request that produced no output (time limit, refused or cancelled before its first)."""
        return RequestMetrics(self._arrival, None, None, time.monotonic(), 0, 0)
