"""Embedding requests in a step (`engine/pooling.py`): which hidden rows each one's pooling reads is decided when the
step's inputs are prepared (`pool_rows`), the runner takes those rows off the forward's hidden states
(`pool_hidden`), and the scheduler folds them into the sequence's pooling state (`PooledChunk.apply`) and ends the
request once its whole prompt is computed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.core.sequence import Sequence
from pagedserve.engine.pooling import PoolingState


@dataclass(frozen=True, slots=True)
class PoolRows:
    """Hidden rows [first_row, first_row + count) of a step, at positions start, start + 1, ... of `seq`'s prompt
    (count 0: this chunk holds none its pooling reads); `done`: the chunk computes the prompt's last position."""

    seq: Sequence
    first_row: int
    count: int
    start: int
    done: bool


@dataclass(frozen=True, slots=True)
class PooledChunk:
    seq: Sequence
    start: int
    total: torch.Tensor | None  # fp32 [hidden] on the host: the sum of the rows read; None: none in this chunk
    count: int
    done: bool

    def apply(self) -> None:
        state = self.seq.features.of(PoolingState)
        if self.total is not None:
            state.add(self.start, self.total, self.count)
        if self.done:
            state.finish()


def pool_rows(seq: Sequence, start: int, end: int, first_row: int) -> PoolRows | None:
    """For an embedding sequence computing positions [start, end) from hidden row first_row on; None for others."""
    state = seq.features.of(PoolingState)
    if state is None:
        return None
    wanted = state.wants(start, end, seq.num_prompt_tokens)
    done = end >= seq.num_prompt_tokens
    if wanted is None:
        return PoolRows(seq, first_row, 0, start, done)
    lo, hi = wanted
    return PoolRows(seq, first_row + lo - start, hi - lo, lo, done)


def pool_hidden(hidden: torch.Tensor, rows: tuple[PoolRows, ...]) -> tuple[PooledChunk, ...]:
    """Each chunk's rows summed in fp32 now (a copy: the hidden states may be a buffer the next step reuses)."""
    return tuple(PooledChunk(r.seq, r.start, hidden[r.first_row : r.first_row + r.count].float().sum(dim=0).cpu()
                             if r.count else None, r.count, r.done) for r in rows)
