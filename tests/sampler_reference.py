"""An independent reference for the sampler: the next-token distribution computed by hand (numpy, float64) from a
logits row and SamplingParams, a seeded draw of many samples through the product's Sampler, a distribution check
with a stated false-failure rate, and the mutation harness that makes the sampler ignore one option.

The reference follows the documented order (docs/architecture.md, engine/runner/sampler.py; vLLM's order too): logit bias,
repetition penalty (prompt and output tokens: divide positive logits, multiply negative ones), frequency and
presence penalties (output tokens), min_tokens (EOS unless ignore_eos, and stop_token_ids, banned), temperature,
then top_k (tokens tied with the k-th kept), one softmax over the survivors, and on that distribution top_p (a token
survives while the mass of strictly more likely tokens is below top_p; equal tokens share that mass) and min_p (a
token survives when its probability is at least min_p times the largest).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch

from pagedserve.engine import SamplingParams
from pagedserve.engine.runner.sampler import Sampler
from pagedserve.engine.runner.seeded_sampling import SeededSampling
from pagedserve.engine.core.sequence import Sequence, SequenceMetrics

# The value of each option that turns it off: a sampler that "ignores" an option reads this instead.
NEUTRAL = {
    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": None, "min_tokens": 0,
}
FALSE_FAILURE_RATE = 1e-6


def expected_distribution(
    logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int], eos: frozenset[int],
    margin: float = 1e-5,
) -> np.ndarray:
    """`margin`: how close to a cut (top_k, top_p, min_p) a token may fall before the case is refused as testing
    rounding rather than the option (float32 in the product; a model's logits also differ from the reference's)."""
    row = np.asarray(logits, dtype=np.float64).copy()
    for token, bias in (params.logit_bias or {}).items():
        row[token] += bias
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            rp = params.repetition_penalty
            row[token] = row[token] * rp if row[token] < 0 else row[token] / rp
    for token, count in Counter(output).items():
        row[token] -= params.frequency_penalty * count + params.presence_penalty
    if len(output) < params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        row[list(banned)] = -np.inf
    if params.temperature == 0:
        onehot = np.zeros_like(row)
        onehot[int(np.argmax(row))] = 1.0
        return onehot
    row = (row - row.max()) / params.temperature
    if params.top_k:
        kth = np.sort(row)[::-1][min(params.top_k, row.size) - 1]
        _check_well_posed("top_k", row, kth, margin)
        row[row < kth] = -np.inf
    probs = np.exp(row)
    probs /= probs.sum()
    above = np.array([probs[probs > p].sum() for p in probs])
    keep = probs >= params.min_p * probs.max()
    if params.min_p:
        with np.errstate(divide="ignore"):  # in log space: the margin is on logits, like top_k's
            _check_well_posed("min_p", np.log(probs), np.log(params.min_p * probs.max()), margin)
    if params.top_p < 1:
        _check_well_posed("top_p", above[above > 0], params.top_p, margin)
        keep &= above < params.top_p
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def _check_well_posed(option: str, values: np.ndarray, cut: float, margin: float) -> None:
    """Exact ties with the cut (equal logits, 0.25 against 0.25) are meant; a value merely near it is refused."""
    near = (np.abs(values - cut) < margin) & (values != cut) & np.isfinite(values)
    assert not near.any(), f"{option}: a token lies within {margin} of the cut {cut}: pick another case"


class IgnoringOption:
    """The mutation harness: SamplingParams as a sampler that ignores `option` would read them (that option at its
    neutral value, every other field and property as they are). Installed on the sequences the test hands the
    product's Sampler, so the product's code runs unchanged except for that one value."""

    __slots__ = ("_params", "_option")

    def __init__(self, params: SamplingParams, option: str):
        assert option in NEUTRAL, option
        self._params, self._option = params, option

    def __getattr__(self, name: str):
        if name == self._option:
            return NEUTRAL[name]
        return getattr(self._params, name)


def _sequence(prompt: list[int], output: list[int], params, seed: int, forks: int) -> Sequence:
    seq = Sequence("dist", 0, list(prompt) + list(output), len(prompt), params, SequenceMetrics(arrival_time=0.0))
    seq.pending_forks = forks
    seq.features.attach(SeededSampling(seed, torch.Generator().manual_seed(seed)))
    return seq


def draw(
    logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int], eos: frozenset[int],
    samples: int, seed: int = 0, ignore: str | None = None,
) -> np.ndarray:
    """Counts per token of `samples` draws through the product's Sampler. With no output yet, one row draws every
    sample (the sampler's n-way fork path); once there are output tokens each draw needs its own row, all in one
    sampler call."""
    sampler = Sampler(eos)
    seen = IgnoringOption(params, ignore) if ignore else params
    if output:
        seqs = tuple(_sequence(prompt, output, seen, seed + i, 0) for i in range(samples))
    else:
        seqs = (_sequence(prompt, output, seen, seed, samples - 1),)
    batch = torch.tensor(np.asarray(logits, dtype=np.float32)).unsqueeze(0).expand(len(seqs), -1).contiguous()
    picks = [tok for result in sampler(batch, seqs) for tok, _ in result.tokens]
    if params.greedy:
        picks = picks * samples  # greedy rows give one token per row, whatever n
    return np.bincount(picks, minlength=len(logits))


def l1_bound(support: int, samples: int, failure_rate: float = FALSE_FAILURE_RATE) -> float:
    """Bretagnolle-Huber-Carol: P(sum |p_hat - p| >= eps) <= 2^k exp(-n eps^2 / 2) for k categories and n draws,
    so a correct sampler exceeds this eps with probability below `failure_rate` (and the seeds are fixed)."""
    return math.sqrt(2 * (support * math.log(2) + math.log(1 / failure_rate)) / samples)


def assert_matches(counts: np.ndarray, expected: np.ndarray) -> None:
    """A token of probability 0 is never drawn; the empirical distribution is within the L1 bound of `expected`."""
    impossible = np.flatnonzero((expected == 0) & (counts > 0))
    assert impossible.size == 0, f"drew tokens of probability 0: {impossible.tolist()} ({counts[impossible].tolist()})"
    n = int(counts.sum())
    distance = float(np.abs(counts / n - expected).sum())
    bound = l1_bound(int((expected > 0).sum()), n)
    assert distance <= bound, f"L1 distance {distance:.4f} > {bound:.4f}: {np.round(counts / n, 3)} vs {np.round(expected, 3)}"
