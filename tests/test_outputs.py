"""Engine outputs carry deltas: each step copies only what is new, and the history stays in the sequence's own
append-only lists until someone reads it."""

from __future__ import annotations

import random

import pytest
from conftest import make_tiny_model
from service_fixtures import off_main_thread

from pagedserve.engine import LLMEngine, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.request_outputs import _samples_metrics, request_output
from pagedserve.engine.core.sequence import OutputText


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> LLMEngine:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-outputs"))
    return off_main_thread(LLMEngine, EngineConfig(model=str(path), dtype="float32", max_model_len=256))


def test_each_step_carries_only_the_new_tokens_and_shares_the_history(tiny_engine):
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, logprobs=1)
    tiny_engine.add_request("deltas", list(range(100, 120)), params)
    seqs = tiny_engine.requests["deltas"].seqs
    outputs = []
    while tiny_engine.has_unfinished_requests():
        outputs += tiny_engine.step()
    decode_steps = outputs[1:]  # the first step samples the first token of both samples
    assert all(len(c.new_token_ids) == 1 == len(c.new_logprobs) for o in decode_steps for c in o.outputs)
    for completion, seq in zip(outputs[-1].outputs, sorted(seqs, key=lambda s: s.index)):
        assert completion.history.tokens is seq.token_ids  # a reference: nothing was copied to make the output
        assert completion.history.logprobs is seq.logprobs
        streamed = [t for o in outputs for c in o.outputs if c.index == seq.index for t in c.new_token_ids]
        assert completion.token_ids == tuple(streamed) and completion.num_tokens == 24
        assert [lp.token_id for lp in completion.logprobs] == streamed
        assert completion.text == "".join(c.new_text for o in outputs for c in o.outputs if c.index == seq.index)
    early = outputs[3].outputs[0]
    assert len(early.token_ids) == early.num_tokens < 24  # an earlier output still reads its own length


def test_one_sample_outputs_carry_the_metrics_the_samples_rule_gives(tiny_engine):
    """A one-sample request's output is built without the walk over samples (request_output's shortcut): its
    metrics must be what the n > 1 rule gives for the same sequence, while it runs and once it ends."""
    tiny_engine.add_request("one", list(range(100, 110)), SamplingParams(max_tokens=5, ignore_eos=True))
    state = tiny_engine.requests["one"]
    checked = 0
    while tiny_engine.has_unfinished_requests():
        tiny_engine.step()
        built = request_output(state)
        assert built.metrics == _samples_metrics(state.seqs, state.finished)
        assert built.finished == state.finished and built.outputs[0].index == 0
        checked += 1
    assert built.finished and built.metrics.finished_time and built.metrics.first_token_time and checked == 5


def test_output_text_reads_the_tail_without_the_whole_text():
    rng = random.Random(0)
    text, whole = OutputText(), ""
    for _ in range(300):
        piece = "".join(rng.choice("ab é") for _ in range(rng.randrange(0, 6)))
        text.append(piece)
        whole += piece
        start = max(0, len(whole) - rng.randrange(0, 30))
        assert text.tail(start) == whole[start:] and text.length == len(whole)
    before = text.pieces
    text.truncate(40)
    assert text.value() == whole[:40] and text.length == 40
    assert "".join(before) == whole  # a reader holding the old pieces keeps the text it was given
