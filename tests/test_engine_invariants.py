"""No leaked KV blocks, clear errors for impossible requests, aborts free blocks at once."""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.errors import CapacityError, InvalidRequestError


def assert_no_blocks_held(engine):
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_aborts_and_finishes_leave_no_block_held(llm_fp32):
    engine = llm_fp32.engine
    for i in range(6):
        engine.add_request(f"inv-{i}", f"Story number {i}: once upon a time, in a kingdom by the sea, there lived a princess who", SamplingParams(temperature=0, max_tokens=20))
    engine.add_request("inv-n", "Two friends", SamplingParams(n=3, temperature=1.0, max_tokens=20, seed=3))
    for _ in range(4):
        engine.step()
    assert engine.stats().num_free_kv_blocks < engine.stats().num_kv_blocks
    aborted = engine.abort_request("inv-2")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    engine.abort_request("inv-n")
    assert engine.abort_request("inv-2") is None  # unknown now
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in ("inv-2", "inv-n")
    assert_no_blocks_held(engine)
    # Prefix blocks of finished requests stay cached (evictable), so an identical prompt hits them.
    before = engine.stats().prefix_cache_hits
    llm_fp32.generate(["Story number 1: once upon a time, in a kingdom by the sea, there lived a princess who"], SamplingParams(temperature=0, max_tokens=2))
    assert engine.stats().prefix_cache_hits > before
    assert_no_blocks_held(engine)


def test_request_larger_than_the_kv_cache_is_refused(default_model):
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4
    llm = LLM(str(default_model.weights), dtype="float32", kv_cache_memory=4 * block_bytes)
    with pytest.raises(CapacityError) as info:
        llm.generate(["word " * 40], SamplingParams(max_tokens=40))
    assert info.value.field == "max_tokens" and "KV cache" in str(info.value)
    assert not llm.engine.has_unfinished_requests()
    ok = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=8))  # still serving
    assert len(ok[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt_token_ids"),
        ([1, 2, 10**6], SamplingParams(), "prompt_token_ids"),
        ([1, -3], SamplingParams(), "prompt_token_ids"),
        ("hi", SamplingParams(max_tokens=10**5), "max_tokens"),
        ("hi", SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        ("hi", SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
    ],
)
def test_invalid_requests_name_the_field(llm_fp32, prompt, params, field):
    with pytest.raises(InvalidRequestError) as info:
        llm_fp32.engine.add_request("bad", prompt, params)
    assert info.value.field == field
    assert not llm_fp32.engine.has_unfinished_requests()


def test_a_refused_prompt_in_a_generate_list_leaves_no_request_behind(llm_fp32):
    """vLLM's LLM.generate aborts what it added when a later prompt is refused; so does ours: the valid prompts
    before the bad one neither hold blocks nor run into the next call."""
    ok = SamplingParams(temperature=0, max_tokens=6)
    with pytest.raises(InvalidRequestError) as info:
        llm_fp32.generate(["first", "second", [1, -3]], ok)
    assert info.value.field == "prompt_token_ids"
    assert not llm_fp32.engine.has_unfinished_requests()
    assert_no_blocks_held(llm_fp32.engine)
    out = llm_fp32.generate(["third"], ok)
    assert len(out) == 1 and out[0].outputs[0].finish_reason in ("length", "stop")


def test_an_interrupted_generate_aborts_its_requests(llm_fp32, monkeypatch):
    """Ctrl-C (or any exception) mid-generate: the call's requests are aborted, not left to run in the next call."""
    step, steps = llm_fp32.engine.step, []

    def interrupted():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm_fp32.engine, "step", interrupted)
    aborted = llm_fp32.engine.num_aborted_requests
    with pytest.raises(KeyboardInterrupt):
        llm_fp32.generate(["one", "two"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert llm_fp32.engine.num_aborted_requests == aborted + 2
    assert not llm_fp32.engine.has_unfinished_requests()
    assert_no_blocks_held(llm_fp32.engine)


def test_a_request_ended_before_its_first_token_reports_all_n_samples(llm_fp32):
    """n > 1 samples fork off the first token; a request aborted (or failed) before it still ends with n outputs,
    each with the finish reason, so a front end sees every index of an n-sample request however it ends (it saw one).
    Found by tests/test_fuzz_engine_api.py."""
    engine = llm_fp32.engine
    engine.add_request("before-first", "Two friends", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))
    out = engine.abort_request("before-first")
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert {c.finish_reason for c in out.outputs} == {"abort"} and all(not c.token_ids for c in out.outputs)
    assert not engine.has_unfinished_requests()
    assert_no_blocks_held(engine)


def test_over_long_prompt_is_rejected(default_model):
    llm = LLM(str(default_model.weights), dtype="float32", max_model_len=32)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([list(range(100, 140))], SamplingParams(max_tokens=1))
    assert info.value.field == "prompt_token_ids" and "32" in str(info.value)


def test_incremental_detokenization_never_emits_broken_utf8(llm_fp32):
    engine = llm_fp32.engine
    engine.add_request("utf8", "日本語の文章を書いてください。東京は", SamplingParams(temperature=0.8, seed=5, max_tokens=40))
    deltas = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].new_text)
            final = out.outputs[0]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == final.text == llm_fp32.tokenizer.decode(list(final.token_ids))
