"""Which request goes first (vLLM's `--scheduling-policy`).

- fcfs: arrival order; under KV pressure the newest running sequence gives way, and goes back to the head of the
  queue.
- priority: a request's `priority` first (lower is earlier, as vLLM), then arrival: the queue is kept in that order,
  and under KV pressure the running sequence that ranks last (lowest priority, newest) gives way. As in vLLM, a
  waiting request never preempts a running one to get in; it is admitted first once there is room.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine's config names the policies without importing the core
    from pagedserve.engine.core.sequence import Sequence


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"

    def enqueue(self, waiting: deque[Sequence], seq: Sequence, preempted: bool = False) -> None:
        """Puts `seq` where it waits its turn (a preempted sequence keeps its place by its own rank)."""
        if self is SchedulingPolicy.FCFS:
            if preempted:
                waiting.appendleft(seq)
            else:
                waiting.append(seq)
            return
        key = rank(seq)
        at = next((i for i, other in enumerate(waiting) if rank(other) > key), len(waiting))
        waiting.insert(at, seq)

    def order_running(self, running: list[Sequence]) -> None:
        """Puts the sequence that gives way first under KV pressure last (the scheduler preempts from the end)."""
        if self is SchedulingPolicy.PRIORITY:
            running.sort(key=rank)


def rank(seq: Sequence) -> tuple[int, float, int]:
    return seq.priority, seq.metrics.arrival_time, seq.seq_id


SCHEDULING_POLICIES = tuple(p.value for p in SchedulingPolicy)
