"""Speculative sampling keeps the target's distribution: the verifier against the distribution computed by hand,
the engine against itself without drafts; wrong acceptance rules are caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from conftest import make_tiny_model
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.core.sequence import Sequence, SequenceMetrics
from pagedserve.engine.runner.sampler import Sampler
from pagedserve.engine.runner.seeded_sampling import SeededSampling
from pagedserve.engine.spec_decode.verifier import Verifier
from sampler_reference import assert_matches, expected_distribution
from spec_fixtures import SMALL, spec

ROWS = np.array([
    [3.0, 2.5, 2.5, 2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0, -20.0],
    [0.0, 1.0, 2.0, 0.5, 2.2, -1.0, 0.3, 0.0, -3.0, 1.5, 0.1, -0.4],
    [1.0, 1.0, -1.0, 0.0, 0.2, 2.0, -2.0, 0.7, 0.0, 0.0, 1.2, -5.0],
])
DRAFTS = (0, 4)  # likely at row 0, fairly likely at row 1


def verify_many(params: SamplingParams, samples: int, drafts=DRAFTS) -> list[tuple[int, ...]]:
    verifier = Verifier(Sampler(frozenset({11})))
    logits = torch.tensor(ROWS[: len(drafts) + 1], dtype=torch.float32)
    outs = []
    for i in range(samples):
        seq = Sequence("v", 0, [5, 6, 7], 2, params, SequenceMetrics(arrival_time=0.0))
        seq.features.attach(SeededSampling(1000 + i, torch.Generator().manual_seed(1000 + i)))
        outs.append(tuple(tok for tok, _ in verifier(logits, seq, drafts).tokens))
    return outs


def position_counts(outs, drafts=DRAFTS) -> list[np.ndarray]:
    """Per position j: the tokens emitted there by the samples whose drafts before j were all accepted."""
    counts = []
    for j in range(len(drafts) + 1):
        reached = [o[j] for o in outs if len(o) > j and o[:j] == drafts[:j]]
        counts.append(np.bincount(reached, minlength=ROWS.shape[1]))
    return counts


CASES = [SamplingParams(temperature=1.0), SamplingParams(temperature=2.0, top_k=5),
         SamplingParams(temperature=1.5, top_p=0.8), SamplingParams(temperature=0.7, logit_bias={4: 1.0})]


@pytest.mark.parametrize("params", CASES, ids=["t1", "topk", "topp", "bias"])
def test_verifier_keeps_the_target_distribution(params):
    counts = position_counts(verify_many(params, 6000))
    for j, observed in enumerate(counts):
        assert_matches(observed, expected_distribution(ROWS[j], params, [5], [6, 7], frozenset({11})))
    assert counts[1].sum() > 500 and counts[0][0] < counts[0].sum()  # accepted and rejected both


def test_verifier_is_reproducible_per_seed():
    params = SamplingParams(temperature=1.0)
    assert verify_many(params, 50) == verify_many(params, 50)


def always_accept(probs, order, drafts, generator):
    last = len(drafts)
    return [*drafts, int(order[last, torch.multinomial(probs[last], 1, generator=generator)])]


def resample_from_target(probs, order, drafts, generator):
    """Accepts with p(d) but, on rejection, samples from p itself instead of the residual: biased towards d."""
    picks = []
    for row, draft in enumerate(drafts):
        place = int(torch.nonzero(order[row] == draft)[0])
        if float(torch.rand((), generator=generator)) < float(probs[row, place]):
            picks.append(draft)
            continue
        picks.append(int(order[row, torch.multinomial(probs[row], 1, generator=generator)]))
        return picks
    return [*picks, int(order[len(drafts), torch.multinomial(probs[len(drafts)], 1, generator=generator)])]


@pytest.mark.parametrize("wrong", [always_accept, resample_from_target])
def test_a_wrong_acceptance_rule_is_detected(monkeypatch, wrong):
    monkeypatch.setattr(Verifier, "_rejection", staticmethod(wrong))
    params = SamplingParams(temperature=1.0)
    counts = position_counts(verify_many(params, 6000))
    with pytest.raises(AssertionError):
        for j, observed in enumerate(counts):
            assert_matches(observed, expected_distribution(ROWS[j], params, [5], [6, 7], frozenset({11})))


@pytest.fixture(scope="module")
def tiny16(tmp_path_factory):
    """A 16-token vocabulary (a near-flat distribution at temperature 1: drafts are mostly rejected, some accepted),
    and a prompt of its own greedy text."""
    model = str(make_tiny_model(tmp_path_factory.mktemp("spec-tiny16"), vocab_size=16, seed=3))
    base = LLM(model, **SMALL)
    start = [3, 4, 5, 6, 7, 8, 9, 10]
    own = base.generate([start], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].token_ids
    return model, base, start + list(own)


def engine_samples(engine_llm: LLM, prompt: list[int], samples: int = 600) -> np.ndarray:
    """Counts of (first, second) output tokens over seeded requests; the second is the first speculated position."""
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True) for s in range(samples)]
    pairs = np.zeros((16, 16), dtype=np.int64)
    for out in engine_llm.generate([prompt] * samples, params):
        first, second = out.outputs[0].token_ids[:2]
        pairs[first, second] += 1
    return pairs.reshape(-1)


def chi_square_p(a: np.ndarray, b: np.ndarray) -> float:
    keep = (a + b) >= 5
    table = np.stack([a[keep], b[keep]])
    return float(chi2_contingency(table).pvalue)


def test_engine_sampling_distribution_with_and_without_speculation(tiny16, monkeypatch):
    model, base, prompt = tiny16
    want = engine_samples(base, prompt)
    spec_llm = LLM(model, **SMALL, speculative=spec(3, disable_by_batch_size=1000))
    assert chi_square_p(want, engine_samples(spec_llm, prompt)) > 1e-3
    s = spec_llm.engine.stats()
    assert 10 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens - 100
    monkeypatch.setattr(Verifier, "_rejection", staticmethod(always_accept))
    assert chi_square_p(want, engine_samples(spec_llm, prompt)) < 1e-6
