"""Async scheduling's look-ahead: the next step, scheduled while the step in flight still runs on the device.

vLLM's --async-scheduling: the host launches step N+1 before it has read step N's tokens, so the device does not
wait while the host applies them (stop rules, detokenizing, outputs) and schedules again. That is possible in the
steady state recognised here: every running sequence decodes one token in the step in flight, that token is its
row's argmax picked on the device (`Sampler.picks_on_device`), nobody waiting could be admitted, and every sequence's
next position fits the free blocks without preempting anyone. Then each sequence computes the token the step in
flight samples (`ScheduledSeq.input_pending`: the runner copies it on the device). Anything else (a prompt to admit,
a preemption, sampling on the host, speculation) is a synchronous step, which reads the tokens first.

The step in flight is committed here: its positions' K/V are written by its forward, which the device runs before
anything launched later, and every token of the blocks that fill up is known (the pending one lies past them). A
sequence the step in flight stops (EOS, a stop string) keeps its look-ahead row, whose token is dropped when it comes
back; its blocks are freed meanwhile, and the row's stale write reaches the device before any later owner's writes.
A sequence the step in flight ends for certain (max_tokens, the context limit) gets no row.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from pagedserve.engine.core.sequence import Sequence, SeqStatus
from pagedserve.engine.pooling import PoolingState


def schedule_ahead(scheduler: Scheduler, inflight: SchedulerOutput,
                   picks_on_device: Callable[[Sequence], bool]) -> SchedulerOutput | None:
    """The step after `inflight`, or None when it must wait for `inflight`'s tokens. On success `inflight` is
    committed (the caller's `Scheduler.update` must not commit it again)."""
    if scheduler.drafter is not None or scheduler.long_rope_after is not None or scheduler.stop is None:
        return None
    if scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs:
        return None  # a request may be admitted: that is a synchronous step's schedule
    items = [item for item in inflight.scheduled if not item.seq.is_finished]
    # Every running sequence is in flight (each appears once in a step): nobody is left out of the look-ahead.
    if len(items) != len(scheduler.running) or not all(_decodes_one(item, picks_on_device) for item in items):
        return None
    max_len = scheduler.stop.max_model_len
    ahead = [item.seq for item in items if not _ends_after_this_token(item.seq, max_len)]
    blocks = scheduler.block_manager
    # Two positions from the committed ones: the token in flight, then the look-ahead's.
    if not ahead or sum(blocks.blocks_to_take(seq, 2) for seq in ahead) > blocks.num_free_blocks:
        return None
    scheduler.commit(inflight)
    copies = [copy for seq in ahead for copy in blocks.allocate(seq, 1)]
    return SchedulerOutput(tuple(ScheduledSeq(seq, 1, input_pending=True) for seq in ahead), tuple(copies))


def _decodes_one(item: ScheduledSeq, picks_on_device: Callable[[Sequence], bool]) -> bool:
    """One position, the sequence's last, whose token is picked on the device (an embedding sequence picks none)."""
    seq = item.seq
    return item.num_new_tokens == 1 and not item.draft_tokens and seq.status is SeqStatus.RUNNING and \
        seq.num_computed_tokens + 1 == seq.num_tokens and PoolingState not in seq.features and picks_on_device(seq)


def _ends_after_this_token(seq: Sequence, max_model_len: int) -> bool:
    """The token in flight is its last whatever it is: max_tokens or the context limit (`stopping.py`)."""
    max_tokens = seq.params.max_tokens  # None only before admission sets it
    return (max_tokens is not None and seq.num_output_tokens + 1 >= max_tokens) or seq.num_tokens + 1 >= max_model_len
