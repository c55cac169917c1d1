"""Iteration-level scheduling: every step picks which sequences compute how many tokens.

There are no prefill or decode phases: each running sequence computes the gap between its computed and its
total tokens, limited by a per-step token budget, so chunked prefill and mixed prefill+decode batches fall out.
Under KV pressure the newest running sequence is preempted and later recomputed (its outputs are kept).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.sequence import Sequence, SeqStatus, now


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSeq, ...]
    block_copies: tuple[tuple[int, int], ...]  # (src, dst) copy-on-write pairs, applied before the forward

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running.pop()  # the newest running sequence gives way
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            copies += self.block_manager.allocate(seq, num_new)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            index += 1
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, copies)
        return SchedulerOutput(tuple(scheduled), tuple(copies))

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSeq], copies: list[tuple[int, int]]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            fresh = not seq.block_table
            hit = self.block_manager.lookup_prefix(seq) if fresh else None
            hit_tokens = len(hit.block_ids) * self.block_manager.block_size if hit else 0
            num_new = min(seq.num_tokens - seq.num_computed_tokens - hit_tokens, budget)
            if not self.block_manager.can_allocate(seq, num_new, hit):
                break
            self.waiting.popleft()
            if hit is not None:
                self.block_manager.record_lookup(seq, hit)
                if seq.metrics.first_scheduled_time is None:
                    seq.metrics.num_cached_tokens = hit_tokens
            copies += self.block_manager.allocate(seq, num_new, hit)
            seq.status = SeqStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now()
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return budget

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV blocks, keep the tokens (prompt and outputs alike)."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def commit(self, output: SchedulerOutput) -> None:
        """The forward for `output` ran: its tokens are now computed, full blocks become shareable, and blocks that
        fell out of every sliding window go back to the pool (after being published: their contents stay valid)."""
        for item in output.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit_full_blocks(item.seq)
            self.block_manager.release_out_of_window(item.seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sibling joins the batch right after its parent."""
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and release its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.block_manager.free(seq)
