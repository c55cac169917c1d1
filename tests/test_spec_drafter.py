"""The n-gram drafter on its own, no engine: the config and the serve flag take vLLM's keys, proposals and match
lengths equal a brute-force search's, and the draft count follows the match, backs off after rejections and fits
the batch size and the native step's row budget."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from pagedserve.engine import SamplingParams
from pagedserve.engine.core.sequence import Sequence, SequenceMetrics
from pagedserve.engine.errors import ConfigError, InvalidRequestError
from pagedserve.engine.runner.native_capacity import NativeCapacity
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.engine.spec_decode.drafter import Drafter, SpecBackoff
from pagedserve.engine.spec_decode.ngram import MATCH_CAP, draft_count, find_ngram, propose_ngram
from pagedserve.service.spec_flags import add_speculative_flags, speculative_config
from spec_fixtures import spec


# -- configuration ----------------------------------------------------------------------------------
def test_config_takes_vllms_keys_and_names_bad_ones():
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 3, 3)
    assert (SpeculativeConfig(2).prompt_lookup_min, SpeculativeConfig(2).prompt_lookup_max) == (5, 5)
    for text, field in [('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
                         "prompt_lookup_min"),
                        ('{"num_speculative_tokens": 2, "model": "x"}', "model"),
                        ('{"method": "ngram"}', "num_speculative_tokens"),
                        ('{"num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size"),
                        ("[1]", "speculative_config")]:
        with pytest.raises(ConfigError) as info:
            SpeculativeConfig.from_json(text)
        assert info.value.field.endswith(field), (text, info.value.field)
    with pytest.raises(InvalidRequestError) as bad:
        SamplingParams(speculative="yes")
    assert bad.value.field == "speculative"


def test_serve_flag_takes_vllms_json():
    parser = argparse.ArgumentParser()
    add_speculative_flags(parser)
    assert speculative_config(parser.parse_args([])) is None
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                                      '"prompt_lookup_min": 2, "prompt_lookup_max": 4}'])
    assert speculative_config(args) == SpeculativeConfig(3, "ngram", 2, 4)
    with pytest.raises(ConfigError) as info:
        speculative_config(parser.parse_args(["--speculative-config", '{"num_speculative_tokens": "4"}']))
    assert info.value.field == "speculative_config.num_speculative_tokens"


# -- the proposer -----------------------------------------------------------------------------------
def brute_force(tokens, k, lo, hi):
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tuple(tokens[start + n : start + n + k])
    return ()


def test_ngram_proposals_match_a_brute_force_search():
    rng = np.random.default_rng(0)
    proposed = 0
    for trial in range(400):
        tokens = rng.integers(0, 1 + trial % 7, size=int(rng.integers(1, 40))).tolist()
        k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        got = propose_ngram(tokens, k, lo, hi)
        assert got == brute_force(tokens, k, lo, hi), (tokens, k, lo, hi)
        proposed += bool(got)
    assert 50 < proposed < 400
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == (7, 1)  # the most recent occurrence


def brute_force_length(tokens, lo, hi):
    """How far back the occurrence brute_force chose matches the sequence's end (at most max(n, MATCH_CAP))."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                end, m = start + n - 1, n
                while m < MATCH_CAP and end - m >= 0 and tokens[end - m] == tokens[-1 - m]:
                    m += 1
                return m
    return None


def test_match_length_and_draft_count():
    rng = np.random.default_rng(1)
    for trial in range(400):
        tokens = rng.integers(0, 1 + trial % 5, size=int(rng.integers(1, 60))).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 20))
        match = find_ngram(tokens, lo, hi)
        assert (None if match is None else match.length) == brute_force_length(tokens, lo, hi), (tokens, lo, hi)
    copied = list(range(100, 140))
    match = find_ngram([7, *copied, 8, *copied[:30]], 2, 4)  # a 4-gram lookup that matches 30 tokens back
    assert (match.length, match.continuation(3)) == (MATCH_CAP, (130, 131, 132))
    assert [draft_count(m) for m in (1, 2, 3, 4, 5, 6, 16)] == [1, 1, 3, 4, 6, 7, 22]


def test_adaptive_drafts_follow_the_match_length():
    """A two-token repeat drafts one token, a long copy k; with adaptive_drafts off, k whenever there are k."""
    metrics = SequenceMetrics(arrival_time=0.0)
    short = [1, 2, 9, 9, 9, 5, 6, 7, 8, 3, 1, 2]  # "1 2" recurs, nothing before it
    long = [*range(20, 40), 4, *range(20, 30)]
    for tokens, adaptive, want in ((short, True, (9,)), (short, False, (9, 9, 9, 5)), (long, True, (30, 31, 32, 33)),
                                   (long[:-7], True, (23, 24, 25))):  # 3 matched: 3 drafts
        seq = Sequence("a", 0, tokens, len(tokens), SamplingParams(max_tokens=100), metrics)
        seq.num_computed_tokens = len(tokens) - 1
        assert Drafter(spec(4, lo=2, hi=4, adaptive_drafts=adaptive), 512).propose(seq, 10) == want
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.from_json('{"num_speculative_tokens": 2, "adaptive_drafts": 1}')
    assert info.value.field == "speculative_config.adaptive_drafts"


def test_drafter_backs_off_after_rejections_and_resets_on_acceptance():
    drafter = Drafter(spec(2), max_model_len=512)
    tokens = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    seq = Sequence("b", 0, tokens, 8, SamplingParams(max_tokens=100), SequenceMetrics(arrival_time=0.0))
    seq.num_computed_tokens = len(tokens) - 1
    assert drafter.propose(seq, 10) == (7, 8)
    skipped = []
    for _ in range(4):  # four all-rejected verifications in a row: 1, 2, 4, 8 steps without drafts
        Drafter.observe(seq, 0)
        steps = 0
        while not drafter.propose(seq, 10):
            steps += 1
        skipped.append(steps)
    assert skipped == [1, 2, 4, 8]
    Drafter.observe(seq, 1)
    Drafter.observe(seq, 0)
    assert seq.features.of(SpecBackoff).skip == 1  # an acceptance started the count again


def test_by_default_only_a_lone_sequence_speculates_whatever_the_native_step():
    """Unset, disable_by_batch_size is 1 on every engine (spec_decode/config.py says why); a value the user sets
    wins."""
    from pagedserve.engine.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE

    for capacity in (NativeCapacity(), NativeCapacity(2), NativeCapacity(16), NativeCapacity(2, 12)):
        drafter = Drafter(SpeculativeConfig(4), 512, capacity)
        assert drafter.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE == 1
        assert drafter.active(1) and not drafter.active(2)
    drafter = Drafter(spec(4, disable_by_batch_size=6), 512, NativeCapacity(8))
    assert drafter.active(6) and not drafter.active(7)


def test_drafts_are_trimmed_by_the_runners_own_size_rule():
    """The drafter sizes drafts with the native step's `NativeCapacity` (the rule `accepts` applies): k while the
    step fits, the row budget's share past max_batch, k where not even one draft each fits (the torch path)."""
    capacity = NativeCapacity(max_batch=2, max_rows=12)
    drafter = Drafter(spec(4, disable_by_batch_size=64), 512, capacity)
    assert [drafter.drafts_per_sequence(n) for n in (1, 2, 3, 4, 6, 7)] == [4, 4, 3, 2, 1, 4]
    for n in (1, 2, 3, 4, 6):
        d = drafter.drafts_per_sequence(n)
        assert capacity.serves(n, n * (1 + d), True)
    assert not capacity.serves(7, 7 * 2, True) and not capacity.serves(3, 3, False)
    assert Drafter(spec(4), 512).drafts_per_sequence(3) == 4  # no native step: all k on the torch path
