"""Speculative decoding (n-gram prompt lookup): greedy outputs token-identical to decoding without drafts (several k,
preemption, FP8 KV, stop strings, logprobs, SmolLM2), sampling distribution-preserving (the verifier against the
distribution computed by hand, the engine against itself without drafts; wrong acceptance rules are caught), block
tables and the prefix cache consistent after every step, the config and the proposer against a brute-force one."""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from conftest import make_tiny_model
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.core.block_manager import FREED, chain_hash
from pagedserve.engine.errors import ConfigError, InvalidRequestError
from pagedserve.engine.core.sequence import Sequence, SequenceMetrics
from pagedserve.engine.runner.native_capacity import NativeCapacity
from pagedserve.engine.runner.sampler import Sampler
from pagedserve.engine.runner.seeded_sampling import SeededSampling
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.engine.spec_decode.drafter import Drafter, SpecBackoff
from pagedserve.engine.spec_decode.ngram import MATCH_CAP, draft_count, find_ngram, propose_ngram
from pagedserve.engine.spec_decode.verifier import Verifier
from pagedserve.service.spec_flags import add_speculative_flags, speculative_config
from sampler_reference import assert_matches, expected_distribution

REPEATS = [
    "the cat sat on the mat and the cat sat on the mat and the dog ran to the cat " * 3,
    "one two three four five six one two three four five six one two three",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
]


# Each engine's KV cache is allocated up front: small ones keep the module's memory low.
SMALL = {"dtype": "float32", "kv_cache_memory": 32 << 20}


def spec(k: int, **kw) -> SpeculativeConfig:
    """Speculation at every batch size these tests run (the default, a lone sequence, has a test of its own)."""
    lo, hi = kw.pop("lo", 1), kw.pop("hi", 3)
    kw.setdefault("disable_by_batch_size", 32)
    return SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("spec-tiny")))


@pytest.fixture(scope="module")
def tiny_base(tiny):
    return LLM(tiny, **SMALL)


def ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


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


# -- sampling: the distribution is the target's -----------------------------------------------------
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
