"""The streams of the requests in flight, shared by AsyncEngine's two sides: the event loops register and release
them, the loop thread routes each step's outputs to them and forgets the finished ones.

Two maps, one lock: client request id -> stream while the client waits on it (its id is taken), engine id -> stream
until the engine is done with it. They part when a client gives up: its id is free at once (a retry under the same
id may follow immediately), while the engine still holds the request until the loop thread applies the abort.
"""

from __future__ import annotations

import asyncio
import threading

from pagedserve.engine.errors import InvalidRequestError, QueueFullError, RequestFailedError
from pagedserve.engine.loop_commands import Sink
from pagedserve.engine.outputs import RequestOutput

Routed = dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]]


class StreamTable:
    def __init__(self, max_queued_requests: int):
        self.max_queued_requests = max_queued_requests
        self._lock = threading.Lock()
        self._by_client: dict[str, Sink] = {}
        self._by_engine: dict[str, Sink] = {}
        self._pending_adds = 0  # registered, not yet applied by the loop thread: waiting, though the engine can't tell

    def __len__(self) -> int:
        """Streams a client still waits on."""
        with self._lock:
            return len(self._by_client)

    def register(self, sink: Sink, num_waiting: int) -> None:
        """Takes the client id and counts the request as waiting; `num_waiting` is the engine's own queue."""
        with self._lock:
            if sink.request_id in self._by_client:
                raise InvalidRequestError("request_id", f"{sink.request_id!r} is already in flight")
            if self._pending_adds + num_waiting >= self.max_queued_requests:
                raise QueueFullError(f"admission queue is full ({self.max_queued_requests} requests waiting)")
            self._by_client[sink.request_id] = sink
            self._by_engine[sink.engine_id] = sink
            self._pending_adds += 1

    def adds_applied(self, count: int) -> None:
        """The loop thread submitted `count` registered requests (the engine's waiting count now has them)."""
        with self._lock:
            self._pending_adds -= count

    def of_client(self, request_id: str) -> Sink | None:
        with self._lock:
            return self._by_client.get(request_id)

    def is_live(self, sink: Sink) -> bool:
        """False once the stream was forgotten: aborted before its add reached the loop thread."""
        with self._lock:
            return self._by_engine.get(sink.engine_id) is sink

    def release(self, sink: Sink) -> None:
        """The client stopped waiting: its id is free at once; the engine side goes when the abort is applied."""
        with self._lock:
            if self._by_client.get(sink.request_id) is sink:
                del self._by_client[sink.request_id]

    def forget(self, sink: Sink) -> bool:
        with self._lock:
            return self._forget_locked(sink)

    def route(self, outputs: list[RequestOutput]) -> Routed:
        """Each output with its stream's queue, grouped by event loop (one wake-up per loop and step: with 64
        streams, a cross-thread wake-up per request cost the compute threads a core's worth of interruptions);
        finished requests are forgotten, failed ones delivered as RequestFailedError."""
        routed: Routed = {}
        with self._lock:
            for out in outputs:
                sink = self._by_engine.get(out.request_id)
                if sink is None:
                    continue
                if out.finished:
                    self._forget_locked(sink)
                item = RequestFailedError(out.error) if out.error is not None else out
                routed.setdefault(sink.loop, []).append((sink.queue, item))
        return routed

    def take_loop(self, loop: asyncio.AbstractEventLoop) -> list[Sink]:
        """Every stream whose caller waits on `loop`, forgotten at once (that loop is closed)."""
        with self._lock:
            sinks = [sink for sink in self._by_engine.values() if sink.loop is loop]
            for sink in sinks:
                self._forget_locked(sink)
        return sinks

    def take_all(self) -> list[Sink]:
        """Every stream the engine holds, forgotten at once (the engine failed or is shutting down)."""
        with self._lock:
            sinks, self._by_engine, self._by_client = list(self._by_engine.values()), {}, {}
        return sinks

    def _forget_locked(self, sink: Sink) -> bool:
        """Drops the stream from both maps; False if it was already gone (finished or failed meanwhile)."""
        if self._by_client.get(sink.request_id) is sink:
            del self._by_client[sink.request_id]
        return self._by_engine.pop(sink.engine_id, None) is sink
