"""What the scheduler hands the runner for one step (`SchedulerOutput`: which sequences compute how many positions,
and the copy-on-write block copies to apply first) and what applying the runner's output changed (`StepUpdate`, for
the engine's request outputs). The runner's side of the boundary is step_output.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # positions computed this step, the draft tokens included
    draft_tokens: tuple[int, ...] = ()  # speculative tokens after the sequence's last one (not in seq.token_ids)
    # Async scheduling (engine/core/lookahead.py): the one position computed is the token the step in flight samples,
    # not yet in seq.token_ids; the runner takes it from that step's device tokens.
    input_pending: bool = False


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


@dataclass(slots=True)
class StepUpdate:
    """What a step changed, for the engine's outputs: the requests whose sequences got tokens or ended (in order),
    the sequences forked off this step (n > 1), and the requests whose logits failed (to be ended whole)."""

    touched: dict[str, None] = field(default_factory=dict)
    forked: list[Sequence] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
