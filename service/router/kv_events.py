"""Fans the engine's prefix-cache events out to subscribers (SubscribeKvEvents), each with a bounded buffer.

The hub keeps its own copy of the cached blocks, updated with every batch it publishes, so a new subscriber
first gets a snapshot of exactly the state the following batches continue from: no gap, no duplicate. Publishing
runs on the engine thread and never waits for a subscriber: one that falls `max_pending` batches behind is dropped
(its stream ends with RESOURCE_EXHAUSTED) and may resubscribe for a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from pagedserve.engine.errors import PagedServeError
from pagedserve.engine.kv_events import BlockRemoved, BlockStored, KvEvent


class SubscriberDroppedError(PagedServeError):
    """The subscriber read too slowly; the engine does not wait for it."""


@dataclass(frozen=True, slots=True)
class EventBatch:
    sequence_number: int  # 1, 2, ... per published batch; a snapshot carries the number it is current at
    timestamp: float  # unix seconds
    events: tuple[KvEvent, ...]
    snapshot: bool = False  # True: a resync (clear everything, then these stores)
    first_event_id: int = 0  # events are numbered 1, 2, ... over the engine's life; 0 in a snapshot


class Subscription:
    def __init__(self, hub: KvEventHub, max_pending: int):
        self.hub, self.max_pending = hub, max_pending
        self.loop = asyncio.get_running_loop()
        self._pending: deque[EventBatch] = deque()
        self._ready = asyncio.Event()
        self.dropped_at: int | None = None  # sequence number that did not fit

    def offer(self, batch: EventBatch) -> None:
        """On the subscriber's event loop."""
        if self.dropped_at is not None:
            return
        if len(self._pending) >= self.max_pending:
            self.dropped_at = batch.sequence_number
            self._pending.clear()
        else:
            self._pending.append(batch)
        self._ready.set()

    async def next(self) -> EventBatch:
        while not self._pending:
            if self.dropped_at is not None:
                raise SubscriberDroppedError(
                    f"KV event subscriber fell {self.max_pending} batches behind at sequence {self.dropped_at} and "
                    "was dropped so the engine never waits; resubscribe for a fresh snapshot")
            self._ready.clear()
            await self._ready.wait()
        return self._pending.popleft()

    def close(self) -> None:
        self.hub.unsubscribe(self)


class KvEventHub:
    def __init__(self, max_pending: int = 1024):
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._sequence = 0
        self._events_published = 0
        self._blocks: OrderedDict[int, BlockStored] = OrderedDict()  # insertion order: parents before children
        self._subscribers: set[Subscription] = set()

    def publish(self, events: list[KvEvent]) -> None:
        """Engine thread: record the batch and hand it to every subscriber's loop without waiting."""
        with self._lock:
            self._sequence += 1
            for event in events:
                if isinstance(event, BlockStored):
                    self._blocks[event.block_hash] = event
                else:
                    self._blocks.pop(event.block_hash, None)
            batch = EventBatch(self._sequence, time.time(), tuple(events), first_event_id=self._events_published + 1)
            self._events_published += len(events)
            for sub in self._subscribers:
                try:
                    sub.loop.call_soon_threadsafe(sub.offer, batch)
                except RuntimeError:
                    pass  # its loop closed: the server is stopping

    def subscribe(self) -> Subscription:
        """The first batch of the subscription is a snapshot of the cache as of the latest published batch."""
        sub = Subscription(self, self.max_pending)
        with self._lock:
            sub.offer(EventBatch(self._sequence, time.time(), tuple(self._blocks.values()), snapshot=True))
            self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subscribers.discard(sub)

    def cached_hashes(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._blocks)


def apply(state: dict[int, BlockStored], batch: EventBatch) -> None:
    """What a subscriber does with a batch: the replica of the worker's prefix cache it keeps."""
    if batch.snapshot:
        state.clear()
    for event in batch.events:
        if isinstance(event, BlockRemoved):
            state.pop(event.block_hash, None)
        else:
            state[event.block_hash] = event
