"""What one step of the model runner returns: per sampling sequence, the tokens it gets (logits never leave the
runner). The scheduler's `update` applies it; nothing else reads it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pagedserve.engine.core.sequence import Sequence, TokenLogprob

if TYPE_CHECKING:
    from pagedserve.engine.runner.pooled_rows import PooledChunk
    from pagedserve.engine.runner.prompt_logprobs import ScoredPrompt

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SeqSample:
    """One sequence's outcome. Plain sampling: one token, or n on a request's first token (the first is the
    sequence's own, the rest start its forked siblings). Speculation (`num_drafts` > 0): the accepted drafts, then
    the model's own token, appended in order."""

    seq: Sequence
    tokens: tuple[tuple[int, TokenLogprob | None], ...]
    num_drafts: int = 0  # drafts verified this step (0: no speculation)
    num_accepted: int = 0
    error: str | None = None  # the row could not be sampled (logits not finite, `row_failure`); `tokens` is empty
    dead_end: bool = False  # the row's constraint allows no token; `tokens` is empty


@dataclass(frozen=True, slots=True)
class StepOutput:
    """Verified sequences first, then the plainly sampled ones (the order draws come from unseeded generators)."""

    samples: tuple[SeqSample, ...]
    prompt_logprobs: tuple[ScoredPrompt, ...] = ()  # prompt tokens scored this step (any chunk, sampling or not)
    pooled: tuple[PooledChunk, ...] = ()  # the embedding sequences' chunks of this step, pooled

    def with_prompt_logprobs(self, scored: tuple[ScoredPrompt, ...]) -> StepOutput:
        return replace(self, prompt_logprobs=scored) if scored else self

    def with_pooled(self, pooled: tuple[PooledChunk, ...]) -> StepOutput:
        return replace(self, pooled=pooled) if pooled else self

    @staticmethod
    def empty() -> StepOutput:
        return _EMPTY


_EMPTY = StepOutput(())


def row_failure(seq: Sequence, stage: str, exc: Exception) -> str:
    """A `SeqSample.error` for one row whose own processing raised (logged with its traceback): only its request
    ends, where an exception out of the step would end every request in flight."""
    logger.exception("request %s: %s failed; only this request ends", seq.request_id, stage)
    return f"internal error in this request's sampling, {stage} ({type(exc).__name__}: {exc})"
