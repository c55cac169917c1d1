"""Per-sequence feature state lives in `Sequence.features`, one registered `SeqFeature` per feature; `Sequence.fork`
forks every state (and nothing else copies any), as each feature's own rule says."""

from __future__ import annotations

import dataclasses
import typing

import torch

from pagedserve.engine.core.seq_features import FEATURE_KINDS, SeqFeature, SeqFeatures
from pagedserve.engine.core.sequence import Sequence, SequenceMetrics
from pagedserve.engine.loading.tokenizer import DetokState
from pagedserve.engine.lora.config import AdapterInfo
from pagedserve.engine.lora.weights import LoraWeights
from pagedserve.engine.runner.seeded_sampling import SeededSampling, generator_for
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.spec_decode.drafter import SpecBackoff
from pagedserve.engine.reasoning import ThoughtMarker
from pagedserve.engine.structured_output.backend import ConstraintMatcher, GrammarState
from pagedserve.engine.thought_budget import ThoughtBudget


class _Matcher(ConstraintMatcher):
    vocab_words = 1

    def __init__(self, position: int = 0):
        self.position = position

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = -1

    def accept(self, token):
        self.position += 1
        return True

    def is_terminated(self):
        return False

    def fork(self):
        return _Matcher(self.position)


def _sequence() -> Sequence:
    seq = Sequence("r", 0, [1, 2, 3], 3, SamplingParams(n=3, seed=5), SequenceMetrics(0.0), pending_forks=2)
    info = AdapterInfo("a", 7, "/x", 1, ())
    seq.adapter = info
    budget = ThoughtBudget(2, ThoughtMarker("<think>"), ThoughtMarker("</think>", (8, 9)), opened=True, forced=1)
    for state in (DetokState(1, 3), SeededSampling.start(5), GrammarState(_Matcher(4), ThoughtMarker("</think>")),
                  LoraWeights(info, ()), SpecBackoff(3, 2), budget):
        seq.features.attach(state)
    return seq


def test_every_feature_kind_is_a_slotted_dataclass_with_its_own_fork():
    kinds = {DetokState, SeededSampling, GrammarState, LoraWeights, SpecBackoff, ThoughtBudget}
    assert kinds <= set(FEATURE_KINDS.values())
    for kind in FEATURE_KINDS.values():
        assert kind.fork is not SeqFeature.fork, kind
        assert "__slots__" in vars(kind), kind
        assert kind is LoraWeights or dataclasses.is_dataclass(kind), kind


def test_fork_forks_every_state_by_its_own_rule():
    seq = _sequence()
    child = seq.fork(2)
    assert child.adapter is seq.adapter and child.pending_forks == 0
    detok = child.features.of(DetokState)
    assert (detok.prefix_offset, detok.read_offset) == (1, 3) and detok is not seq.features.of(DetokState)
    sampling = child.features.of(SeededSampling)
    assert sampling.seed == 5
    assert torch.equal(torch.rand(4, generator=sampling.generator), torch.rand(4, generator=generator_for(5, 2)))
    grammar = child.features.of(GrammarState)
    assert grammar.matcher.position == 4 and grammar.matcher is not seq.features.of(GrammarState).matcher
    assert grammar.waits_for == ThoughtMarker("</think>")  # a sample forked inside the thought waits on its own
    grammar.watch(0, "</think>")
    assert grammar.applies and not seq.features.of(GrammarState).applies
    budget = child.features.of(ThoughtBudget)
    assert (budget.left, budget.forced, budget.opened) == (2, 1, True) and budget is not seq.features.of(ThoughtBudget)
    assert child.features.of(LoraWeights) is seq.features.of(LoraWeights)  # samples share their adapter
    assert child.features.of(SpecBackoff) is None  # a forked sample speculates afresh
    assert set(child.features) == {DetokState, SeededSampling, GrammarState, LoraWeights, ThoughtBudget}


def test_a_sequence_holds_no_untyped_per_feature_field():
    hints = typing.get_type_hints(Sequence)
    assert "Any" not in {str(h) for h in hints.values()} and hints["features"] is SeqFeatures
    assert not {"sampler_state", "detok", "matcher", "lora", "spec_skip", "spec_misses"} & set(hints)
