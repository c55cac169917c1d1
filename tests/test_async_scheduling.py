"""Async scheduling (`--async-scheduling`, engine/core/lookahead.py): a decode step is launched before the step in
flight's tokens are read. Every output must equal the synchronous engine's, token for token, with stops, aborts,
preemption and failed rows; the look-ahead must actually run; every block must come back."""

from __future__ import annotations

import argparse

import openai
import pytest

from conftest import make_tiny_model
from service_fixtures import metric_value, server_factory, shared_server  # noqa: F401  (real server processes)
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.block_manager import BlockManager
from pagedserve.engine.core.lookahead import schedule_ahead
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.sequence import Sequence, SequenceMetrics
from pagedserve.engine.errors import ConfigError
from pagedserve.engine.lora.config import LoraConfig
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.service.cli import add_engine_flags

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Write a haiku about the sea", "1, 2, 3, 4,", "Explain gravity to a child"]


def outcome(outs) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def llm_async(default_model):
    return LLM(str(default_model.weights), dtype="float32", async_scheduling=True)


def test_greedy_outputs_equal_the_synchronous_engine_with_every_kind_of_stop(llm_fp32, llm_async):
    """max_tokens of 1 and 2 (no look-ahead row at all), a stop token id, a stop string, and a long one."""
    free = [o.outputs[0].token_ids for o in llm_fp32.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))]
    params = [
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=2),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[free[2][5]]),
        SamplingParams(temperature=0, max_tokens=48, stop=[llm_fp32.engine.tokenizer.decode(free[3][8:10])]),
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
    ]
    prompts = [*PROMPTS, "Once upon a time"]
    before = llm_async.engine.num_lookahead_steps
    expected = outcome(llm_fp32.generate(prompts, params))
    assert outcome(llm_async.generate(prompts, params)) == expected
    assert [r[2] for r in expected] == ["length", "length", "stop", "stop", "length"]
    assert llm_async.engine.num_lookahead_steps - before >= 25  # the long one decoded ahead
    assert llm_async.engine.block_manager.num_used_blocks == 0 and not llm_async.engine.has_unfinished_requests()


def test_sampled_rows_with_bias_allowed_tokens_and_logprobs_decode_ahead_with_the_same_draws(llm_fp32, llm_async):
    """Seeded temperature with top-k/top-p/min-p, a logit bias, allowed tokens and logprobs are picked on the
    device: the steps are launched ahead, and every seed draws the tokens (and logprobs) the synchronous engine
    does."""
    ids = llm_fp32.engine.tokenizer.encode(" the sea and the sky were blue")
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, max_tokens=20, logit_bias={ids[1]: 3.0}),
        SamplingParams(temperature=0.7, seed=5, max_tokens=20, allowed_token_ids=ids, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
    ]
    before = llm_async.engine.num_lookahead_steps
    ahead, synchronous = llm_async.generate(PROMPTS, params), llm_fp32.generate(PROMPTS, params)
    assert outcome(ahead) == outcome(synchronous)
    assert llm_async.engine.num_lookahead_steps - before >= 15
    # Equal up to float rounding: a look-ahead step may hold a row the synchronous one does not (a sequence that
    # stopped in the step before), and a batch of another size may round the logits differently in the last bit.
    got, want = ahead[3].outputs[0].logprobs, synchronous[3].outputs[0].logprobs
    assert len(got) == len(want) == 20
    for a, b in zip(got, want):
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 2
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)


def test_penalties_and_min_tokens_count_the_token_in_flight(llm_fp32, llm_async):
    """Repetition, presence and frequency penalties and min_tokens read the output so far, whose last token is still
    on the device when a look-ahead step samples: they count it, and every output equals the synchronous engine's."""
    params = [
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=6, max_tokens=24, presence_penalty=0.8, frequency_penalty=0.6),
        SamplingParams(temperature=0, max_tokens=24, min_tokens=12, frequency_penalty=1.5),
        SamplingParams(temperature=0.9, seed=8, max_tokens=24, min_tokens=20, repetition_penalty=1.1, logprobs=1),
    ]
    before = llm_async.engine.num_lookahead_steps
    assert outcome(llm_async.generate(PROMPTS, params)) == outcome(llm_fp32.generate(PROMPTS, params))
    assert llm_async.engine.num_lookahead_steps - before >= 15


def test_rows_the_host_decides_keep_their_steps_synchronous_and_their_tokens(llm_fp32, llm_async):
    """Bad words and n > 1 read what only the host holds: same outputs as the synchronous engine, and no step is
    launched ahead while any of them decodes."""
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=10, bad_words=["the"]),
        SamplingParams(temperature=0, max_tokens=10, presence_penalty=0.5, logprobs=1),
        SamplingParams(temperature=0.7, n=2, seed=11, max_tokens=6, min_tokens=6, ignore_eos=True),
    ]
    before = llm_async.engine.num_lookahead_steps
    assert outcome(llm_async.generate(PROMPTS[:3], params)) == outcome(llm_fp32.generate(PROMPTS[:3], params))
    assert llm_async.engine.num_lookahead_steps == before


def test_an_abort_while_its_row_is_in_flight_drops_the_row_and_frees_its_blocks(llm_fp32, llm_async):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = outcome(llm_fp32.generate([PROMPTS[0], PROMPTS[2]], params))
    engine = llm_async.engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, params)
    outputs = {}
    while not (engine.inflight and any(item.seq.request_id == "r1" for item in engine.inflight.batch.scheduled)
               and engine.requests["r1"].seqs[0].num_output_tokens >= 3):
        for out in engine.step():
            outputs[out.request_id] = out
    kept = tuple(engine.requests["r1"].seqs[0].output_token_ids)
    aborted = engine.abort_request("r1")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort" and aborted.outputs[0].token_ids == kept
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "r1"
            outputs[out.request_id] = out
    assert outcome([outputs["r0"], outputs["r2"]]) == alone
    assert engine.block_manager.num_used_blocks == 0


def test_a_non_finite_row_fails_only_its_request(llm_fp32, llm_async, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = outcome(llm_fp32.generate([PROMPTS[0], PROMPTS[1]], params))
    runner, steps = llm_async.engine.runner, []
    forward = runner._forward

    def poisoned(batch, step, fill=None):
        logits, seqs = forward(batch, step, fill)
        steps.append(1)
        if len(steps) == 4:  # decoding, with a step launched ahead
            logits = logits.clone()
            logits[next(i for i, s in enumerate(seqs) if s.params is victim), 3] = float("nan")
        return logits, seqs

    monkeypatch.setattr(runner, "_forward", poisoned)
    victim = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm_async.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [params, params, victim])
    assert outcome(outs[:2]) == alone and outs[0].error is None and outs[1].error is None
    assert outs[2].error is not None and "not finite" in outs[2].error
    assert llm_async.engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random Llama, synchronous and async, in a KV cache too small for its requests (preemption), on the
    native step and on the torch path (where the pending tokens are copied on the device, not read back)."""
    path = str(make_tiny_model(tmp_path_factory.mktemp("tiny-async"), max_position_embeddings=512))
    common = dict(dtype="float32", kv_cache_memory=1 << 16, block_size=8, max_num_seqs=4)
    return {backend: (LLM(path, attention_backend=backend, **common),
                      LLM(path, attention_backend=backend, async_scheduling=True, **common))
            for backend in ("auto", "torch")}


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_preemption_and_mixed_lengths_match_the_synchronous_engine(tiny_pair, backend):
    sync, ahead = tiny_pair[backend]
    blocks = sync.engine.block_manager.num_blocks
    prompts = [list(range(5 + i, 30 + 9 * i)) for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (60, 3, 45, 70)]
    expected = outcome(sync.generate(prompts, params))
    assert sync.engine.scheduler.num_preemptions > 0, f"{blocks} blocks held every request: no preemption tested"
    before = ahead.engine.num_lookahead_steps
    assert outcome(ahead.generate(prompts, params)) == expected
    assert ahead.engine.num_lookahead_steps > before and ahead.engine.scheduler.num_preemptions > 0
    assert ahead.engine.block_manager.num_used_blocks == 0


def _seq(n: int, request_id: str, max_tokens: int = 16) -> Sequence:
    return Sequence(request_id, 0, list(range(1, n + 1)), n, SamplingParams(temperature=0, max_tokens=max_tokens),
                    SequenceMetrics(0.0))


class _Stop:
    max_model_len = 64


def _decoding(num_blocks: int, *seqs: Sequence, max_num_seqs: int = 8) -> tuple[Scheduler, object]:
    """A scheduler whose sequences have prefilled and sampled once: the returned batch is their first decode."""
    sched = Scheduler(BlockManager(num_blocks, 4, enable_prefix_caching=False), max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=64, stop=_Stop())
    for s in seqs:
        sched.add(s)
    sched.commit(sched.schedule())
    for s in seqs:
        s.token_ids.append(7)
    return sched, sched.schedule()


def test_the_look_ahead_schedules_only_the_steady_decode_state():
    always = lambda seq: True  # noqa: E731
    sched, batch = _decoding(16, _seq(5, "a"), _seq(6, "b", max_tokens=2))
    ahead = schedule_ahead(sched, batch, always)
    # "b" ends with the token in flight (its second of max_tokens=2): no row for it; "a" computes the pending token
    assert [(i.seq.request_id, i.num_new_tokens, i.input_pending) for i in ahead.scheduled] == [("a", 1, True)]
    assert [s.num_computed_tokens for s in sched.running] == [6, 7]  # the step in flight is committed
    assert len(sched.running[0].block_table) == 2  # room for position 7 (blocks of 4)

    sched, batch = _decoding(16, _seq(5, "a"))
    assert schedule_ahead(sched, batch, lambda seq: False) is None  # a token picked on the host
    sched.add(_seq(3, "late"))
    assert schedule_ahead(sched, batch, always) is None  # someone could be admitted
    assert sched.running[0].num_computed_tokens == 5  # nothing was committed

    sched, batch = _decoding(3, _seq(8, "a"), _seq(4, "b"))  # 3 blocks held, position 8 needs a fourth
    assert schedule_ahead(sched, batch, always) is None  # no room: a synchronous step preempts


def test_the_config_and_the_cli_name_the_field():
    with pytest.raises(ConfigError) as info:
        EngineConfig(async_scheduling=True, speculative=SpeculativeConfig(num_speculative_tokens=2))
    assert info.value.field == "async_scheduling" and "speculative" in str(info.value)
    with pytest.raises(ConfigError) as info:
        EngineConfig(async_scheduling=True, lora=LoraConfig())
    assert info.value.field == "async_scheduling" and "LoRA" in str(info.value)
    with pytest.raises(ConfigError) as info:
        EngineConfig(async_scheduling="yes")
    assert info.value.field == "async_scheduling"
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert parser.parse_args(["--async-scheduling"]).async_scheduling is True
    assert parser.parse_args([]).async_scheduling is None


def test_a_server_with_async_scheduling_answers_as_the_default_one(server_factory, shared_server):  # noqa: F811
    """A real server process with --async-scheduling: completions (streamed and not, a stop string) equal the
    default server's, and a stream the client drops mid-way leaves the next request unharmed."""
    server = server_factory("--async-scheduling", "--http-port", "0", name="async")
    requests = [dict(prompt=PROMPTS[0], temperature=0, max_tokens=32),
                dict(prompt=PROMPTS[1], temperature=0, max_tokens=40, stop=[" the"]),
                dict(prompt=PROMPTS[2], temperature=0, max_tokens=24, logprobs=1)]

    def answers(target) -> list[tuple]:
        with openai.OpenAI(base_url=f"{target.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as oai:
            done = [oai.completions.create(model=MODEL, **body).choices[0] for body in requests]
            streamed = "".join(c.choices[0].text for c in oai.completions.create(model=MODEL, stream=True,
                                                                                 **requests[0]))
        return [(c.text, c.finish_reason) for c in done] + [streamed]

    expected = answers(shared_server)
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as oai:
        dropped = oai.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=200, temperature=0, stream=True)
        for _ in zip(range(5), dropped):
            pass
        dropped.close()
    assert answers(server) == expected
    assert metric_value(server, "pagedserve:async_lookahead_steps_total") > 20  # its decode steps looked ahead
    assert metric_value(shared_server, "pagedserve:async_lookahead_steps_total") == 0


def test_an_exception_in_a_row_decided_on_the_device_fails_only_its_request(llm_fp32, llm_async, monkeypatch):
    """Decode ahead: a row whose own rules raise while its step is launched (its token still in flight) fails its
    request when that step is read; its batch mates keep the tokens of the synchronous engine."""
    from pagedserve.engine.runner.sampler import Sampler

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = outcome(llm_fp32.generate([PROMPTS[0], PROMPTS[1]], params))
    process_row, in_flight_calls = Sampler._process_row, []

    def failing(self, row, seq, in_flight):
        if seq.params is victim and in_flight is not None:
            in_flight_calls.append(1)
            if len(in_flight_calls) == 3:
                raise IndexError("injected")
        return process_row(self, row, seq, in_flight)

    monkeypatch.setattr(Sampler, "_process_row", failing)
    victim = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True)
    outs = llm_async.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [params, params, victim])
    assert len(in_flight_calls) >= 3  # it raised in a step launched ahead (one more may be in flight behind it)
    assert outcome(outs[:2]) == alone and outs[0].error is None and outs[1].error is None
    assert outs[2].error is not None and "logits processing" in outs[2].error
    assert {c.finish_reason for c in outs[2].outputs} == {"error"}
    assert llm_async.engine.block_manager.num_used_blocks == 0 and not llm_async.engine.has_unfinished_requests()
