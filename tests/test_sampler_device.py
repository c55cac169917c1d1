"""The sampler and the verifier build every tensor they need where the logits are. On a GPU a tensor made on the
CPU beside CUDA logits fails the step (and a CPU generator cannot drive a CUDA multinomial); no CUDA here, so every
factory call without an explicit device is sent to the meta device (`torch.device("meta")` as the default): any such
tensor meeting the CPU logits raises, as a CPU tensor meeting CUDA logits would. The outputs must equal a run without
that default, seeded rows included."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import SamplingParams
from pagedserve.engine.core.sequence import Sequence, SequenceMetrics
from pagedserve.engine.runner.sampler import Sampler
from pagedserve.engine.runner.seeded_sampling import SeededSampling, generator_for
from pagedserve.engine.spec_decode.verifier import Verifier

VOCAB = 64
EOS = 11
PARAMS = [
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=3, max_tokens=8),
    SamplingParams(temperature=0, logprobs=3, max_tokens=8),
    SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, seed=5,
                   max_tokens=8),
    SamplingParams(temperature=1.0, logit_bias={4: 5.0, 9: -100.0}, min_tokens=4, seed=7, max_tokens=8),
    SamplingParams(temperature=0.9, allowed_token_ids=[1, 4, 11, 30], bad_words_ids=[[4]], seed=9, max_tokens=8),
    SamplingParams(temperature=0.6, n=2, seed=13, max_tokens=8, logprobs=1),
]


def _seqs() -> tuple[Sequence, ...]:
    seqs = []
    for i, params in enumerate(PARAMS):
        tokens = [5, 6, 7, 4, 4, 30]  # three of them outputs (penalties), none where n > 1 forks off the first
        seq = Sequence(f"r{i}", 0, tokens, len(tokens) if params.n > 1 else 3, params, SequenceMetrics(0.0))
        seq.pending_forks = params.n - 1
        if params.seed is not None:
            seq.features.attach(SeededSampling.start(params.seed))
        seqs.append(seq)
    return tuple(seqs)


def _sample(default: str | None) -> list:
    logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    seqs = _seqs()
    verifier = Verifier(Sampler(frozenset({EOS})))
    drafted = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    if default is None:
        samples = Sampler(frozenset({EOS}))(logits, seqs)
        verified = [verifier(drafted.clone(), seq, (4, 30)) for seq in seqs[:4]]
    else:
        with torch.device(default):
            samples = Sampler(frozenset({EOS}))(logits, seqs)
            verified = [verifier(drafted.clone(), seq, (4, 30)) for seq in seqs[:4]]
    return [(s.tokens, s.error) for s in samples] + [(v.tokens, v.num_accepted) for v in verified]


def test_every_tensor_is_made_where_the_logits_are():
    expected = _sample(None)
    assert _sample("meta") == expected
    assert all(error is None for _, error in expected[: len(PARAMS)])
    assert len(expected[len(PARAMS) - 1][0]) == 2  # n = 2: both samples' first tokens


@pytest.mark.parametrize("index", [0, 3])
def test_a_seeded_stream_gets_a_generator_of_the_logits_device_from_its_own_seed(index):
    state = SeededSampling.start(21).fork(index) if index else SeededSampling.start(21)
    cpu = state.on(torch.device("cpu"))
    assert cpu is state.generator
    assert torch.equal(torch.rand(3, generator=cpu), torch.rand(3, generator=generator_for(21, index)))
    assert state.fork(5).index == 5 and state.fork(5).device_generator is None


def test_device_picks_draw_what_the_sampler_draws_and_survive_a_nan_row():
    """Async scheduling's picks (`Sampler.device_picks`) for the rows nothing on the host decides: the same tokens
    and logprobs as `__call__` for every seed, made where the logits are, and a NaN row reported without reaching
    multinomial."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=3, logprobs=3),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=1.0, logit_bias={4: 5.0}, allowed_token_ids=[1, 4, 11, 30], seed=7),
              SamplingParams(temperature=0.5, seed=8, logprobs=1)]

    def seqs() -> tuple[Sequence, ...]:
        out = tuple(Sequence(f"d{i}", 0, [5, 6, 7], 3, p, SequenceMetrics(0.0)) for i, p in enumerate(params))
        for seq in out:
            if seq.params.seed is not None:
                seq.features.attach(SeededSampling.start(seq.params.seed))
        return out

    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    sampler = Sampler(frozenset({EOS}))
    assert all(sampler.picks_on_device(seq) for seq in seqs())
    expected = [s.tokens[0] for s in sampler(logits.clone(), seqs())]
    with torch.device("meta"):
        rows = sampler.device_picks(logits.clone(), seqs())
    on_device = [s.tokens[0] for s in Sampler.device_samples(seqs(), rows.to_host().read())]
    assert on_device == expected and rows.finite.all()
    assert [lp is None for _, lp in expected] == [False, False, True, False] and len(expected[0][1].top) == 3
    poisoned = logits.clone()
    poisoned[3, 2] = float("nan")
    rows = sampler.device_picks(poisoned, seqs())
    assert rows.finite.tolist() == [True, True, True, False]
    assert rows.tokens[:3].tolist() == [t for t, _ in expected[:3]]
    assert not sampler.picks_on_device(Sequence("h", 0, [5, 6, 7], 3, SamplingParams(temperature=0.5,
                                                                                     bad_words_ids=[[4]]),
                                                SequenceMetrics(0.0)))


def test_a_token_in_flight_counts_for_penalties_and_min_tokens():
    """`pending` (async scheduling): a sequence's last token still on the device is penalised and counted toward
    min_tokens as if it were in its token ids."""
    params = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4,
                            min_tokens=3, ignore_eos=False)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(9)) * 3
    sampler = Sampler(frozenset({EOS}))
    known = Sequence("k", 0, [5, 6, 7, 40, 21], 3, params, SequenceMetrics(0.0))  # outputs 40, 21 on the host
    in_flight = Sequence("p", 0, [5, 6, 7, 40], 3, params, SequenceMetrics(0.0))  # 21 still on the device
    expected = sampler.process(logits.clone(), (known,))
    token = torch.tensor([21])
    with torch.device("meta"):
        got = sampler.process(logits.clone(), (in_flight,), {in_flight: token})
    assert torch.equal(got, expected)
    assert not torch.equal(sampler.process(logits.clone(), (in_flight,)), expected)  # without it: not the same
