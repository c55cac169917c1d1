"""The sampler's token distribution under every option, alone and combined, matches the distribution computed by hand
(tests/sampler_reference.py) over many seeded draws, on fixed logits (ties and edge values included) and on real
model steps; and a sampler that ignores any one option fails these checks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from pagedserve.engine import SamplingParams
from sampler_reference import NEUTRAL, assert_matches, draw, expected_distribution, l1_bound

EOS = frozenset({0})
# Token 0 (EOS) is the most likely; 1 and 2 tie; 11 is all but impossible at temperature 1.
LOGITS = np.array([3.0, 2.5, 2.5, 2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0, -20.0])
# Four equal best logits: top_p and min_p must keep or drop them together, whatever order the sort leaves them in.
TIED = np.array([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, -0.5, -1.0])
# Equal logits and a negligible tail give exactly 0.25 each in float32: the top_p edge falls exactly on a mass.
EXACT = np.array([1.0, 1.0, 1.0, 1.0, -30.0, -30.0, -40.0, -50.0])
SAMPLES = 20_000

# name -> (logits, params, prompt tokens, output tokens so far)
CASES = {
    "temperature_1": (LOGITS, SamplingParams(temperature=1.0), [5], []),
    "temperature_0.5": (LOGITS, SamplingParams(temperature=0.5), [5], []),
    "temperature_3": (LOGITS, SamplingParams(temperature=3.0), [5], []),
    "temperature_50": (LOGITS, SamplingParams(temperature=50.0), [5], []),
    "temperature_1e-30_is_greedy": (LOGITS, SamplingParams(temperature=1e-30), [5], []),
    "greedy_with_bias": (LOGITS, SamplingParams(temperature=0, logit_bias={6: 3.5}), [5], []),
    "top_k_2_keeps_the_tie_at_the_boundary": (LOGITS, SamplingParams(top_k=2), [5], []),
    "top_k_5": (LOGITS, SamplingParams(top_k=5, temperature=2.0), [5], []),
    "top_k_1": (LOGITS, SamplingParams(top_k=1, temperature=5.0), [5], []),
    "top_k_beyond_vocab": (LOGITS, SamplingParams(top_k=100), [5], []),
    "top_p_0.6": (LOGITS, SamplingParams(top_p=0.6), [5], []),
    "top_p_0.9_hot": (LOGITS, SamplingParams(top_p=0.9, temperature=2.0), [5], []),
    "top_p_1e-6_is_greedy": (LOGITS, SamplingParams(top_p=1e-6, temperature=3.0), [5], []),
    # Below fp32's range (a valid top_p > 0 that rounds to 0 in fp32): greedy, where it once left nothing to sample.
    "top_p_1e-300_is_greedy": (LOGITS, SamplingParams(top_p=1e-300, temperature=3.0), [5], []),
    "top_p_0.5_four_ties_kept_together": (TIED, SamplingParams(top_p=0.5), [5], []),
    "top_p_0.25_exact_edge": (EXACT, SamplingParams(top_p=0.25), [5], []),
    "min_p_0.3": (LOGITS, SamplingParams(min_p=0.3), [5], []),
    "min_p_0.1_hot": (LOGITS, SamplingParams(min_p=0.1, temperature=2.0), [5], []),
    "min_p_1_keeps_the_tied_best": (TIED, SamplingParams(min_p=1.0, temperature=7.0), [5], []),
    "repetition_1.8": (LOGITS, SamplingParams(repetition_penalty=1.8), [0, 9, 7], [3]),
    "repetition_0.4": (LOGITS, SamplingParams(repetition_penalty=0.4), [4, 9], [5, 5]),
    "frequency_1": (LOGITS, SamplingParams(frequency_penalty=1.0), [5], [1, 1, 1, 4]),
    "frequency_-1": (LOGITS, SamplingParams(frequency_penalty=-1.0), [5], [7, 7, 7, 9]),
    "presence_1.5": (LOGITS, SamplingParams(presence_penalty=1.5), [5], [1, 1, 0, 3, 3]),
    "presence_-2": (LOGITS, SamplingParams(presence_penalty=-2.0), [5], [8, 6]),
    "logit_bias": (LOGITS, SamplingParams(logit_bias={5: 3.0, 0: -100.0, 11: 100.0}), [5], []),
    "min_tokens_bans_eos_and_stop_ids": (LOGITS, SamplingParams(min_tokens=2, stop_token_ids=[3]), [5], [4]),
    "min_tokens_ignore_eos_bans_stop_ids": (
        LOGITS, SamplingParams(min_tokens=2, stop_token_ids=[1], ignore_eos=True), [5], [4]),
    "min_tokens_reached": (LOGITS, SamplingParams(min_tokens=1, stop_token_ids=[3]), [5], [4]),
    "combined": (LOGITS, SamplingParams(
        temperature=0.7, top_k=7, top_p=0.85, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5,
        presence_penalty=0.3, logit_bias={6: 2.0}, min_tokens=3), [1, 6], [2, 2]),
    "combined_hot": (LOGITS, SamplingParams(
        temperature=4.0, top_k=9, top_p=0.7, min_p=0.2, frequency_penalty=-0.8, logit_bias={10: 4.0}), [5], [10]),
}

# For each option, a case whose distribution moves well beyond the check's bound when the sampler ignores it.
CAUGHT_BY = {
    "temperature": ["temperature_0.5", "temperature_3", "combined_hot"],
    "top_k": ["top_k_2_keeps_the_tie_at_the_boundary", "top_k_5", "top_k_1"],
    "top_p": ["top_p_0.6", "top_p_0.9_hot", "top_p_0.5_four_ties_kept_together", "combined_hot"],
    "min_p": ["min_p_0.3", "min_p_1_keeps_the_tied_best"],
    "repetition_penalty": ["repetition_1.8", "repetition_0.4", "combined"],
    "frequency_penalty": ["frequency_1", "frequency_-1", "combined_hot"],
    "presence_penalty": ["presence_1.5", "presence_-2"],
    "logit_bias": ["logit_bias", "greedy_with_bias", "combined_hot"],
    "min_tokens": ["min_tokens_bans_eos_and_stop_ids", "min_tokens_ignore_eos_bans_stop_ids", "combined"],
}


def _run(name: str, ignore: str | None = None):
    logits, params, prompt, output = CASES[name]
    expected = expected_distribution(logits, params, prompt, output, EOS)
    samples = SAMPLES // 4 if output else SAMPLES  # one sampler row per draw once there is output: fewer, still ample
    return draw(logits, params, prompt, output, EOS, samples, seed=len(name), ignore=ignore), expected


@pytest.mark.parametrize("name", sorted(CASES))
def test_sampled_distribution_matches_the_reference(name):
    counts, expected = _run(name)
    assert_matches(counts, expected)


def test_the_edge_cases_mean_what_their_names_say():
    """The hand-computed references of the edge cases, spelled out (so the reference itself is checked)."""
    ref = {name: expected_distribution(c[0], c[1], c[2], c[3], EOS) for name, c in CASES.items()}
    assert ref["temperature_1e-30_is_greedy"][0] == 1.0 and ref["top_p_1e-6_is_greedy"][0] == 1.0
    assert ref["top_p_1e-300_is_greedy"][0] == 1.0
    assert ref["greedy_with_bias"][6] == 1.0
    assert np.flatnonzero(ref["top_k_2_keeps_the_tie_at_the_boundary"]).tolist() == [0, 1, 2]
    assert ref["top_k_1"][0] == 1.0
    assert np.allclose(ref["top_p_0.5_four_ties_kept_together"][:4], 0.25)  # each tie ~0.2: a 3-of-4 cut is wrong
    assert np.allclose(ref["top_p_0.25_exact_edge"][:4], 0.25)  # the best mass already equals top_p: ties stay
    assert np.allclose(ref["min_p_1_keeps_the_tied_best"][:4], 0.25)
    assert ref["min_tokens_bans_eos_and_stop_ids"][[0, 3]].sum() == 0
    assert ref["min_tokens_ignore_eos_bans_stop_ids"][1] == 0 and ref["min_tokens_ignore_eos_bans_stop_ids"][0] > 0.2
    assert ref["logit_bias"][0] < 1e-40 and ref["logit_bias"][11] > 0.99


@pytest.mark.parametrize("option", sorted(NEUTRAL))
def test_a_sampler_ignoring_one_option_fails_the_check(option):
    """The mutation harness: the product's Sampler reading `option` at its neutral value (every other option as
    sent) fails the distribution check on each case listed for that option."""
    for name in CAUGHT_BY[option]:
        counts, expected = _run(name, ignore=option)
        with pytest.raises(AssertionError):
            assert_matches(counts, expected)


def test_every_option_is_covered_by_a_mutation_case():
    """Each mutation case moves the reference by more than twice the check's bound, so a sampler ignoring the
    option fails it with at least the check's own confidence (not by luck of the seed)."""
    assert set(CAUGHT_BY) == set(NEUTRAL)
    for option, names in CAUGHT_BY.items():
        for name in names:
            logits, params, prompt, output = CASES[name]
            assert getattr(params, option) != NEUTRAL[option], (option, name)
            right = expected_distribution(logits, params, prompt, output, EOS)
            ignored = expected_distribution(logits, replace(params, **{option: NEUTRAL[option]}), prompt, output, EOS)
            samples = SAMPLES // 4 if output else SAMPLES
            assert np.abs(right - ignored).sum() > 2.5 * l1_bound(int((right > 0).sum()), samples), (option, name)


# Real model steps: a tiny random Llama (a 256-token vocabulary, logits spread over a few units),
# sampled through the whole engine (admission, n-way forks, per-sample seeded generators), against the same
# checkpoint's logits from transformers. Engine and transformers logits differ by ~1e-5 in fp32, so the cases keep
# every token at least 1e-3 from a cut.
MODEL_PROMPT = [1, 17, 99, 42, 42, 7, 200, 31, 42, 5]
MODEL_CASES = {
    "temperature_top_k": SamplingParams(temperature=0.8, top_k=6),
    "top_p_min_p_repetition_bias": SamplingParams(
        top_p=0.4, min_p=0.3, repetition_penalty=1.6, logit_bias={17: 1.5}, temperature=0.5),
    "min_tokens_bans_a_likely_eos": SamplingParams(min_tokens=1, top_k=5, logit_bias={2: 3.0}),
}
REQUESTS, N = 60, 64  # 3840 draws per case


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from conftest import make_tiny_model
    from pagedserve.engine import LLM

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-sampler"), vocab_size=256, initializer_range=0.15, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32")
    assert llm.engine.tokenizer.eos_token_ids == frozenset({2})
    return llm, hf


def _hf_next_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1].double().numpy()


def _engine_draws(llm, params: SamplingParams, max_tokens: int) -> list[tuple[int, ...]]:
    batch = [replace(params, n=N, seed=1000 + i, max_tokens=max_tokens) for i in range(REQUESTS)]
    outs = llm.generate([MODEL_PROMPT] * REQUESTS, batch)
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.mark.parametrize("name", sorted(MODEL_CASES))
def test_model_step_first_token_distribution(tiny_model, name):
    llm, hf = tiny_model
    params = MODEL_CASES[name]
    expected = expected_distribution(_hf_next_logits(hf, MODEL_PROMPT), params, MODEL_PROMPT, [], frozenset({2}), 1e-3)
    draws = _engine_draws(llm, params, max_tokens=1)
    assert len(draws) == REQUESTS * N
    assert_matches(np.bincount([d[0] for d in draws], minlength=256), expected)


def test_model_step_output_penalties_over_two_tokens(tiny_model):
    """Frequency and presence penalties act on output tokens only: the joint distribution of the first two
    sampled tokens, the second drawn from the model's logits after the first with that token's logit moved (here
    raised: negative penalties, so a repeat is likely enough to see)."""
    llm, hf = tiny_model
    params = SamplingParams(top_k=3, frequency_penalty=-2.0, presence_penalty=-2.0, ignore_eos=True)
    plain = replace(params, frequency_penalty=0.0, presence_penalty=0.0)
    joint = _two_token_distribution(hf, params)
    draws = _engine_draws(llm, params, max_tokens=2)
    assert all(len(d) == 2 for d in draws)
    assert_matches(np.bincount([a * 256 + b for a, b in draws], minlength=256 * 256), joint)
    assert np.abs(joint - _two_token_distribution(hf, plain)).sum() > 0.5  # the penalties had a repeat to act on


def _two_token_distribution(hf, params: SamplingParams) -> np.ndarray:
    eos = frozenset({2})
    first = expected_distribution(_hf_next_logits(hf, MODEL_PROMPT), params, MODEL_PROMPT, [], eos, 1e-3)
    joint = np.zeros(256 * 256)
    for t1 in np.flatnonzero(first).tolist():
        logits = _hf_next_logits(hf, MODEL_PROMPT + [t1])
        joint[t1 * 256: (t1 + 1) * 256] = first[t1] * expected_distribution(logits, params, MODEL_PROMPT, [t1], eos, 1e-3)
    return joint
