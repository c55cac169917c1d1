"""Verification of one step's drafts: the target model's rows for a speculating sequence (its last token, then each
draft) decide which drafts stand and which token follows them.

Greedy: drafts are accepted while each equals the argmax of the row before it; then the argmax of the row after the
last accepted draft is appended (all accepted: the bonus token of the last row). Sampling: rejection sampling with a
one-hot draft distribution (an n-gram draft is certain): draft d is accepted with probability p(d), p being the very
distribution the sampler would sample that row from (bias, temperature, top-k, min-p, top-p); on rejection the token
is sampled from p with d removed, renormalised; the output's distribution is then exactly p's, position by position.
The request's seeded generator draws every uniform and sample, so a seed gives the same output every run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.engine.core.sequence import Sequence
from pagedserve.engine.runner.sampler import NON_FINITE, Sampler
from pagedserve.engine.runner.seeded_sampling import generator_of
from pagedserve.engine.core.step_output import SeqSample, row_failure


@dataclass(slots=True)
class SpecCounters:
    """vLLM's spec-decode counters: sequences that carried drafts, drafts, accepted drafts, accepted per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def count(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


class Verifier:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.counters = SpecCounters()

    def __call__(self, logits: torch.Tensor, seq: Sequence, drafts: tuple[int, ...]) -> SeqSample:
        """`logits` [1 + len(drafts), vocab] fp32: the rows at the sequence's last token and at each draft. An
        exception raised while verifying one sequence fails that sequence's request only, as in the sampler."""
        try:
            return self._verify(logits, seq, drafts)
        except Exception as exc:
            return SeqSample(seq, (), len(drafts), 0, error=row_failure(seq, "its draft verification", exc))

    def _verify(self, logits: torch.Tensor, seq: Sequence, drafts: tuple[int, ...]) -> SeqSample:
        rows = (seq,) * len(logits)
        processed = self.sampler.process(logits, rows)
        row_max, argmax = self.sampler.max_argmax(processed)
        if not bool(torch.isfinite(row_max).all()):
            return SeqSample(seq, (), len(drafts), 0, error=NON_FINITE)
        if seq.params.greedy:
            picks = self._greedy(argmax.tolist(), drafts)
        else:
            probs, order = self.sampler.filtered_probs(processed, row_max, rows, list(range(len(rows))))
            probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p and top-p drop mass: p(d) is of what is left
            picks = self._rejection(probs, order, drafts, generator_of(seq, probs.device))
        raw = torch.log_softmax(logits, dim=-1) if seq.params.logprobs is not None else None
        tokens = tuple((tok, self.sampler.logprob(raw, row, tok, seq)) for row, tok in enumerate(picks))
        accepted = len(picks) - 1
        self.counters.count(len(drafts), accepted)
        return SeqSample(seq, tokens, len(drafts), accepted)

    @staticmethod
    def _greedy(targets: list[int], drafts: tuple[int, ...]) -> list[int]:
        """targets: each row's argmax."""
        picks: list[int] = []
        for row, draft in enumerate(drafts):
            picks.append(targets[row])
            if targets[row] != draft:
                return picks
        picks.append(targets[len(drafts)])
        return picks

    @staticmethod
    def _rejection(probs: torch.Tensor, order: torch.Tensor, drafts: tuple[int, ...],
                   generator: torch.Generator | None) -> list[int]:
        picks: list[int] = []
        for row, draft in enumerate(drafts):
            place = torch.nonzero(order[row] == draft).flatten()
            p_draft = float(probs[row, place[0]]) if place.numel() else 0.0
            if float(torch.rand((), generator=generator, device=probs.device)) < p_draft:
                picks.append(draft)
                continue
            residual = probs[row].clone()
            if place.numel():
                residual[place[0]] = 0.0
            picks.append(int(order[row, torch.multinomial(residual, 1, generator=generator)]))
            return picks
        last = len(drafts)
        picks.append(int(order[last, torch.multinomial(probs[last], 1, generator=generator)]))
        return picks
