"""The greedy pick in C (kernels/cpu/layer_ops.c: each row's maximum and first argmax in one pass) against torch's
amax and argmax, in the default build and the AVX2 and portable tiers (kernels/cpu/isa.py), and the engine's picks with it against torch's."""

from __future__ import annotations

import pytest
import torch

import cpu_tiers
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.runner.row_argmax import native_max_argmax, torch_max_argmax
from pagedserve.kernels.cpu.layer_ops import row_max_argmax
from pagedserve.kernels.cpu.native import load_library



def _special_rows(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, vocab, generator=g)
    x[0, [vocab // 3, vocab - 1]] = 50.0         # a tie: the first index wins
    x[1, vocab // 2] = float("nan")               # a NaN anywhere makes the maximum NaN
    x[2] = float("-inf")                          # no finite logit
    x[3, vocab - 1] = float("inf")                # +inf in the tail past the 16-lane grid
    x[4] = 0.0
    x[4, 1] = -0.0                                # signed zeros tie
    x[5, :-1] = float("-inf")                     # the only finite logit is the last
    x[6, vocab - 1] = 9.0                         # the maximum is the last element
    return x


def _check(logits: torch.Tensor, lib=None) -> None:
    maxima, index = row_max_argmax(logits, lib)
    want_max = logits.amax(dim=-1)
    assert torch.equal(maxima.isnan(), want_max.isnan())
    finite = ~want_max.isnan()
    assert torch.equal(maxima[finite], want_max[finite])
    assert torch.equal(index[finite], logits.argmax(dim=-1)[finite])


@pytest.mark.parametrize("variant", cpu_tiers.params(cpu_tiers.CORE))
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152, 100003])
def test_matches_amax_and_argmax(variant: str, vocab: int) -> None:
    lib = load_library(variant)
    _check(torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)), lib)
    _check(_special_rows(max(vocab, 2)), lib)


def test_strided_rows_and_a_batch_split_across_threads() -> None:
    wide = torch.randn(12, 50000, generator=torch.Generator().manual_seed(1))
    _check(wide[:, :49152])  # rows 50000 apart
    _check(torch.randn(64, 49152, generator=torch.Generator().manual_seed(2)))  # above the split threshold


def test_other_tensors_take_torch() -> None:
    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(4))
    for t in (x.t().contiguous().t(), x.double()):  # column-strided rows, fp64
        got, want = native_max_argmax(t), torch_max_argmax(t)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_engine_greedy_and_speculative_outputs_equal_the_torch_picks() -> None:
    """The same greedy continuations with the C picks as with torch's; with speculation on, both the sampler (steps
    without drafts) and the verifier pick."""
    from pagedserve.engine.spec_decode.config import SpeculativeConfig

    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "List three colours:"]
    params = SamplingParams(temperature=0, max_tokens=24)
    llm = LLM(None, speculative=SpeculativeConfig(3, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=4))
    assert llm.engine.runner.sampler.max_argmax is native_max_argmax
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.runner.verifier.counters.num_drafts > 0
    llm.engine.runner.sampler.max_argmax = torch_max_argmax
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == native
