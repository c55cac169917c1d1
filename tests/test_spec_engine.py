"""Speculative decoding in the engine: greedy outputs token-identical to decoding without drafts (several k, the
native decode step, preemption, LoRA, a sliding window, FP8 KV, stop strings, logprobs, SmolLM2), block tables and
the prefix cache consistent after every step, and the counters vLLM exports."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from conftest import make_tiny_model
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.core.block_manager import FREED, chain_hash
from spec_fixtures import SMALL, spec

REPEATS = [
    "the cat sat on the mat and the cat sat on the mat and the dog ran to the cat " * 3,
    "one two three four five six one two three four five six one two three",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("spec-tiny")))


@pytest.fixture(scope="module")
def tiny_base(tiny):
    return LLM(tiny, **SMALL)


def ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


# -- greedy: token-identical ------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_outputs_are_token_identical(tiny, tiny_base, k):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    engine_llm = LLM(tiny, **SMALL, speculative=spec(k))
    assert ids(engine_llm.generate(REPEATS, params)) == ids(tiny_base.generate(REPEATS, params))
    s = engine_llm.engine.stats()
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens  # some accepted, some rejected
    per_position = s.spec_decode_accepted_per_position
    assert sum(per_position) == s.spec_decode_num_accepted_tokens and len(per_position) <= k
    assert list(per_position) == sorted(per_position, reverse=True)  # position j accepted only after j-1


def check_blocks(engine) -> None:
    """Every reference counted, every free block free, block tables exactly cover the computed tokens."""
    bm, sched = engine.block_manager, engine.scheduler
    refs: Counter[int] = Counter()
    for seq in [*sched.running, *sched.waiting]:
        refs.update(b for b in seq.block_table if b != FREED)
    assert all(block.ref_count == refs[block.block_id] for block in bm.blocks)
    assert bm.num_free_blocks == sum(1 for block in bm.blocks if block.ref_count == 0)
    for seq in sched.running:
        assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
        assert seq.num_computed_tokens == seq.num_tokens - 1


def run_checked(engine_llm, prompts, params) -> list[list[int]]:
    engine = engine_llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        check_blocks(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # The prefix cache holds only blocks of real token sequences: every cached hash is a chain over some finished
    # sequence's prompt + output, never over a rejected draft.
    size, real = engine.block_manager.block_size, set()
    for out in final.values():
        for sample in out.outputs:
            tokens, prev = list(out.prompt_token_ids) + list(sample.token_ids), None
            for start in range(0, len(tokens) - size + 1, size):
                prev = chain_hash(prev, tuple(tokens[start : start + size]))
                real.add(prev)
    assert engine.block_manager.cached_hashes <= real
    return [list(final[f"r{i}"].outputs[0].token_ids) for i in range(len(prompts))]


def test_native_decode_step_verifies_drafts(tiny, tiny_base, monkeypatch):
    """One stream: the drafts are rows of the native decode step (each over the sequence's block table, its context
    ending at its own position), and the tokens stay those of decoding without drafts."""
    from pagedserve.engine.runner.native_step import NativeDecodeStep

    native_drafts = []
    run = NativeDecodeStep.run

    def counting_run(self, step):
        logits = run(self, step)
        native_drafts.append(sum(step.query_lens) - len(step.query_lens))
        assert logits.shape[0] == len(step.sampling_seqs) + native_drafts[-1]
        return logits

    monkeypatch.setattr(NativeDecodeStep, "run", counting_run)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    engine_llm = LLM(tiny, **SMALL, speculative=spec(4))
    assert engine_llm.engine.runner.native_step is not None
    for prompt in REPEATS:
        got, want = engine_llm.generate([prompt], params)[0].outputs[0], tiny_base.generate([prompt], params)[0].outputs[0]
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose([t.logprob for t in got.logprobs], [t.logprob for t in want.logprobs], atol=1e-4)
    assert sum(native_drafts) > 0
    s = engine_llm.engine.stats()
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens


def test_four_speculating_streams_share_the_native_step_within_its_row_budget(tiny, tiny_base, monkeypatch):
    """Past the native step's sequence limit, steps with drafts run natively while their rows fit the row budget
    (the drafter trims each sequence's drafts to its share), with the tokens and logprobs of decoding without."""
    from pagedserve.engine.runner.native_step import NativeDecodeStep

    shapes = []
    run = NativeDecodeStep.run

    def recording_run(self, step):
        shapes.append((len(step.query_lens), sum(step.query_lens), max(step.query_lens) - 1))
        return run(self, step)

    monkeypatch.setattr(NativeDecodeStep, "run", recording_run)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    prompts = [*REPEATS, REPEATS[0][::-1]]
    engine_llm = LLM(tiny, **SMALL, speculative=spec(4, disable_by_batch_size=8), native_step_max_batch=2,
                     native_step_max_rows=12)
    got, want = engine_llm.generate(prompts, params), tiny_base.generate(prompts, params)
    assert ids(got) == ids(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose([t.logprob for t in g.outputs[0].logprobs],
                                   [t.logprob for t in w.outputs[0].logprobs], atol=1e-4)
    four = [shape for shape in shapes if shape[0] == 4]
    assert four and all(rows <= 12 and drafts <= 2 for _, rows, drafts in four)  # 12 rows / 4 sequences: 2 drafts
    assert any(drafts > 0 for _, _, drafts in four)
    s = engine_llm.engine.stats()
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens


def test_an_exception_verifying_one_sequence_fails_only_its_request(tiny, tiny_base, monkeypatch):
    """Three speculating streams; verifying one of them raises mid-generation: that request ends with "error", the
    other two keep the tokens of decoding without drafts, and every block comes back."""
    from pagedserve.engine.spec_decode.verifier import Verifier

    verify, calls = Verifier._verify, []

    def failing(self, logits, seq, drafts):
        if seq.request_id == "r1" and drafts:
            calls.append(1)
            if len(calls) == 2:
                raise ValueError("injected")
        return verify(self, logits, seq, drafts)

    monkeypatch.setattr(Verifier, "_verify", failing)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    engine = LLM(tiny, **SMALL, speculative=spec(4)).engine
    for i, prompt in enumerate(REPEATS):
        engine.add_request(f"r{i}", prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        final.update((out.request_id, out) for out in engine.step() if out.finished)
        check_blocks(engine)
    want = ids(tiny_base.generate(REPEATS, params))
    assert [final[r].outputs[0].token_ids for r in ("r0", "r2")] == [want[0], want[2]]
    assert final["r1"].error is not None and "draft verification" in final["r1"].error
    assert final["r0"].error is None and final["r2"].error is None and len(calls) == 2
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_and_many_rejections_keep_blocks_consistent(tiny, tiny_base):
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    block_bytes = LLM(tiny, dtype="float32", kv_cache_memory=1 << 20).engine.runner.kv_spec.bytes_per_block
    # No row budget and no adaptive length: all 5 drafts of every sequence, so many of them are rejected.
    small = LLM(tiny, dtype="float32", kv_cache_memory=16 * block_bytes, block_size=16,
                speculative=spec(5, disable_by_batch_size=8, adaptive_drafts=False), native_step_max_rows=0)
    got = run_checked(small, REPEATS * 2, params)
    assert got == [list(t) for t in ids(tiny_base.generate(REPEATS * 2, params))]
    s = small.engine.stats()
    assert s.num_preemptions > 0
    assert s.spec_decode_num_draft_tokens - s.spec_decode_num_accepted_tokens > 20  # many rejections


def test_samples_of_n_speculate_after_forking(tiny):
    engine_llm = LLM(tiny, **SMALL, speculative=spec(4))
    # top_k=1: the sampling path, with the greedy loops a random tiny model falls into (so drafts get accepted)
    params = SamplingParams(n=3, temperature=1.0, top_k=1, seed=7, max_tokens=60, ignore_eos=True)
    run_checked(engine_llm, REPEATS[:1], params)
    assert engine_llm.engine.stats().spec_decode_num_accepted_tokens > 0


def test_accepted_tokens_go_out_as_one_delta(tiny):
    engine = LLM(tiny, **SMALL, speculative=spec(4)).engine
    engine.add_request("d", REPEATS[0], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    deltas, counts, history = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            completion = out.outputs[0]
            deltas.append(completion.new_token_ids)
            counts.append(completion.num_tokens)
            history = completion
    assert max(len(d) for d in deltas) > 1  # a step that accepted drafts sent them together
    assert [t for d in deltas for t in d] == list(history.token_ids)
    assert counts == list(np.cumsum([len(d) for d in deltas])) and counts[-1] == 48


def test_lora_adapters_and_the_base_speculate_in_the_same_steps(tiny, tmp_path):
    from lora_fixtures import FOUR, hf_base, make_adapter
    from pagedserve.engine.lora.config import LoraConfig, LoraModule

    adapters = [make_adapter(hf_base(tiny), spec_, tmp_path / spec_.name) for spec_ in FOUR[:2]]
    lora = LoraConfig(modules=tuple(LoraModule(f"a{i}", str(d)) for i, d in enumerate(adapters)), max_loras=2)
    names = [None, "a0", "a1"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outputs = []
    for speculative in (None, spec(4, disable_by_batch_size=8)):
        engine_llm = LLM(tiny, **SMALL, lora=lora, speculative=speculative)
        prompts = [REPEATS[0]] * 3 + [REPEATS[2]] * 3  # each prompt under the base and both adapters
        outputs.append(ids(engine_llm.generate(prompts, params, adapter=names * 2)))
    assert outputs[0] == outputs[1]
    assert len(set(outputs[0][:3])) == 3  # each adapter changes the output
    assert engine_llm.engine.stats().spec_decode_num_accepted_tokens > 0


def test_sliding_window_model_releases_blocks_behind_the_window(tmp_path):
    model = str(make_tiny_model(tmp_path, "MistralForCausalLM", seed=3, sliding_window=24))  # seed 3: it loops
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    base = LLM(model, **SMALL).generate(REPEATS, params)
    spec_llm = LLM(model, **SMALL, speculative=spec(4))
    assert spec_llm.engine.block_manager.window == 24  # every layer slides: blocks behind it are released
    assert run_checked(spec_llm, REPEATS, params) == [list(t) for t in ids(base)]
    assert spec_llm.engine.stats().spec_decode_num_accepted_tokens > 0


def test_fp8_kv_cache(tiny):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = LLM(tiny, **SMALL, kv_cache_dtype="fp8_e4m3")
    spec_llm = LLM(tiny, **SMALL, kv_cache_dtype="fp8_e4m3", speculative=spec(4))
    assert ids(spec_llm.generate(REPEATS, params)) == ids(base.generate(REPEATS, params))
    assert spec_llm.engine.stats().spec_decode_num_accepted_tokens > 0


def test_stop_strings_logprobs_and_per_request_opt_out(tiny, tiny_base):
    probe = tiny_base.generate(REPEATS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    text = probe[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=(stop,), logprobs=2)
    engine_llm = LLM(tiny, **SMALL, speculative=spec(4))
    want, got = tiny_base.generate(REPEATS, params), engine_llm.generate(REPEATS, params)
    for a, b in zip(want, got):
        a, b = a.outputs[0], b.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.stop_reason == b.stop_reason
        assert [t.token_id for t in a.logprobs] == [t.token_id for t in b.logprobs]
        np.testing.assert_allclose([t.logprob for t in a.logprobs], [t.logprob for t in b.logprobs], atol=1e-3)
        assert [[i for i, _ in t.top] for t in a.logprobs] == [[i for i, _ in t.top] for t in b.logprobs]
    assert got[0].outputs[0].finish_reason == "stop"
    drafts = engine_llm.engine.stats().spec_decode_num_drafts
    assert drafts > 0
    off = [replace(params, speculative=False), SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.2)]
    for p in off:
        engine_llm.generate(REPEATS, p)
        assert engine_llm.engine.stats().spec_decode_num_drafts == drafts


def test_prometheus_exports_vllms_spec_decode_counters(tiny):
    from prometheus_client import generate_latest
    from pagedserve.service.core.metrics import ServiceMetrics

    engine_llm = LLM(tiny, **SMALL, speculative=spec(3))
    engine_llm.generate(REPEATS[:1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    s = engine_llm.engine.stats()
    text = generate_latest(ServiceMetrics("m", engine_llm.engine.stats).registry).decode()
    for name, value in [("vllm:spec_decode_num_drafts_total", s.spec_decode_num_drafts),
                        ("vllm:spec_decode_num_draft_tokens_total", s.spec_decode_num_draft_tokens),
                        ("vllm:spec_decode_num_accepted_tokens_total", s.spec_decode_num_accepted_tokens)]:
        assert f'{name}{{model_name="m"}} {float(value)}' in text
    assert s.spec_decode_num_accepted_tokens > 0
    first = s.spec_decode_accepted_per_position[0]
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {float(first)}' in text


def test_speculation_turns_off_above_the_batch_size(tiny):
    engine_llm = LLM(tiny, **SMALL, speculative=spec(3, disable_by_batch_size=2))
    engine_llm.generate(REPEATS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # 3 running
    assert engine_llm.engine.stats().spec_decode_num_drafts == 0
    engine_llm.generate(REPEATS[:2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert engine_llm.engine.stats().spec_decode_num_drafts > 0


# -- the real model ---------------------------------------------------------------------------------
def test_smollm2_greedy_copy_is_token_identical(default_model, llm_fp32):
    text = ("Paged attention stores the key and value cache in fixed-size blocks, so sequences of any length share one "
            "pool of memory without fragmentation, and blocks holding a common prefix are shared between requests.")
    prompt = f"Repeat this sentence exactly.\nSentence: {text}\nRepeated: {text[:40]}"
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=1, stop=("\n\n",))
    spec_llm = LLM(str(default_model.weights), **SMALL, speculative=spec(4, lo=2, hi=4))
    want, got = llm_fp32.generate([prompt], params)[0].outputs[0], spec_llm.generate([prompt], params)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    np.testing.assert_allclose([t.logprob for t in got.logprobs], [t.logprob for t in want.logprobs], atol=1e-3)
    s = spec_llm.engine.stats()
    assert s.spec_decode_num_accepted_tokens > 10 and s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
