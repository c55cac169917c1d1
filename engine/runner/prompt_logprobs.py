"""Prompt logprobs (vLLM's `prompt_logprobs`; OpenAI completions' `echo` with `logprobs`): for the prompt positions a
prefill chunk computes, the logprob of the prompt token that follows each one, its rank and the k best, from the raw
log-softmax of the model's logits (as generated tokens' logprobs). Which hidden rows to score is decided when the
step's inputs are prepared (`prompt_rows`); the runner scores them (`score_prompt_rows`) and the scheduler appends
them to the sequence (`ScoredPrompt.apply`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.engine.core.sequence import Sequence, TokenLogprob

# Rows scored at a time: bounds the fp32 [rows, vocab] logits (50 MiB at a 49k vocabulary) whatever the chunk.
_ROWS_PER_SLICE = 256


@dataclass(frozen=True, slots=True)
class PromptRows:
    """Hidden rows [first_row, first_row + len(targets)) of a step, at positions that predict `targets`: prompt
    tokens first_token, first_token + 1, ... of `seq`."""

    seq: Sequence
    first_row: int
    first_token: int
    targets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ScoredPrompt:
    """The logprobs of prompt tokens first_token, first_token + 1, ... of `seq`."""

    seq: Sequence
    first_token: int
    logprobs: tuple[TokenLogprob, ...]

    def apply(self) -> None:
        """Appends what the sequence does not hold yet (a position scored again, e.g. by a step launched before
        the previous one's update, is not appended twice)."""
        have = len(self.seq.prompt_logprobs) + 1  # the next prompt token without a logprob
        if self.first_token <= have < self.first_token + len(self.logprobs):
            self.seq.prompt_logprobs.extend(self.logprobs[have - self.first_token :])


def prompt_rows(seq: Sequence, start: int, end: int, first_row: int) -> PromptRows | None:
    """The rows of positions [start, end) (the chunk, at hidden row first_row on) that score prompt tokens the
    sequence has no logprob for; None if there are none. Position p scores token p + 1, so the last prompt position
    (it samples the first output token) scores none."""
    if seq.params.prompt_logprobs is None:
        return None
    first = max(start, len(seq.prompt_logprobs))
    last = min(end, seq.num_prompt_tokens - 1)
    if first >= last:
        return None
    return PromptRows(seq, first_row + first - start, first + 1, tuple(seq.token_ids[first + 1 : last + 1]))


def score_prompt_rows(hidden: torch.Tensor, rows: tuple[PromptRows, ...],
                      compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> tuple[ScoredPrompt, ...]:
    return tuple(ScoredPrompt(r.seq, r.first_token, _score(hidden, r, compute_logits)) for r in rows)


def _score(hidden: torch.Tensor, rows: PromptRows,
           compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> tuple[TokenLogprob, ...]:
    k = rows.seq.params.prompt_logprobs or 0
    scored: list[TokenLogprob] = []
    for lo in range(0, len(rows.targets), _ROWS_PER_SLICE):
        targets = rows.targets[lo : lo + _ROWS_PER_SLICE]
        start = rows.first_row + lo
        logprobs = torch.log_softmax(compute_logits(hidden[start : start + len(targets)]).float(), dim=-1)
        index = torch.tensor(targets, dtype=torch.int64, device=logprobs.device).unsqueeze(1)
        chosen = logprobs.gather(1, index)
        ranks = (logprobs > chosen).sum(dim=1) + 1
        chosen_host, ranks_host = chosen.squeeze(1).tolist(), ranks.tolist()
        if k:
            best = torch.topk(logprobs, k, dim=-1)
            top = [tuple(zip(ids, values)) for ids, values in zip(best.indices.tolist(), best.values.tolist())]
        else:
            top = [()] * len(targets)
        scored += [TokenLogprob(token, value, alternatives, rank)
                   for token, value, alternatives, rank in zip(targets, chosen_host, top, ranks_host)]
    return tuple(scored)
