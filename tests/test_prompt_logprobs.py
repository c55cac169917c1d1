"""Prompt logprobs (SamplingParams.prompt_logprobs): every prompt token's logprob, rank and k best equal
transformers' log-softmax of the same fp32 model, however the prefill is chunked, preempted or cached."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.errors import InvalidRequestError

TEXTS = ["The capital of France is Paris, and the capital of Italy is Rome.",
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
         "Les Misérables est un roman de Victor Hugo, publié en 1862."]
TOLERANCE = 1e-4  # fp32 both sides; the engine's kernels sum in other orders than transformers' (seen: 2e-5)


@pytest.fixture(scope="module")
def prompts(hf_reference):
    model, tok = hf_reference
    ids = [tok.encode(t) for t in TEXTS]
    ids.append([(i * 7919) % 40000 + 50 for i in range(300)])  # longer than the chunks below, no structure
    with torch.no_grad():
        refs = [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in ids]
    return ids, refs


@pytest.fixture(scope="module")
def chunked(default_model):
    """Prefill chunks of at most 64 tokens: a prompt's logprobs come from several steps."""
    return LLM(str(default_model.weights), dtype="float32", max_num_batched_tokens=64, max_num_seqs=8)


def assert_matches(prompt: list[int], scores, ref: torch.Tensor, k: int) -> None:
    assert len(scores) == len(prompt) and scores[0] is None
    for i in range(1, len(prompt)):
        lp, row = scores[i], ref[i - 1]
        assert lp.token_id == prompt[i]
        assert abs(lp.logprob - row[prompt[i]].item()) < TOLERANCE, (i, lp.logprob, row[prompt[i]].item())
        assert len(lp.top) == k
        for (token, value), best in zip(lp.top, torch.topk(row, k).values.tolist()):
            assert abs(value - best) < TOLERANCE and abs(row[token].item() - best) < TOLERANCE
        # the rank counts tokens scored higher: exact unless another token is within rounding of this one
        higher = int((row > row[prompt[i]] + TOLERANCE).sum()) + 1
        within = int((row > row[prompt[i]] - TOLERANCE).sum())
        assert higher <= lp.rank <= within, (i, lp.rank, higher, within)


def test_prompt_logprobs_equal_transformers_in_chunks(chunked, prompts):
    ids, refs = prompts
    outs = chunked.generate(ids, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=5))
    for prompt, out, ref in zip(ids, outs, refs):
        assert_matches(prompt, out.prompt_logprobs, ref, 5)
    assert chunked.engine.stats().num_free_kv_blocks == chunked.engine.stats().num_kv_blocks


def test_zero_alternatives_and_one_token_prompts(chunked, prompts):
    ids, refs = prompts
    out, single = chunked.generate([ids[0], ids[0][:1]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
    assert_matches(ids[0], out.prompt_logprobs, refs[0], 0)
    assert single.prompt_logprobs == (None,)
    plain = chunked.generate([ids[0]], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_a_cached_prefix_is_scored_again_and_its_blocks_still_serve_others(chunked, prompts):
    ids, refs = prompts
    first = chunked.generate([ids[3]], SamplingParams(temperature=0, max_tokens=2))[0]
    hits = chunked.engine.stats().prefix_cache_hits
    again = chunked.generate([ids[3]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    assert_matches(ids[3], again.prompt_logprobs, refs[3], 1)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert chunked.engine.stats().prefix_cache_hits == hits  # scored from position 0: no hit taken
    chunked.generate([ids[3]], SamplingParams(temperature=0, max_tokens=2))
    assert chunked.engine.stats().prefix_cache_hits > hits  # a request without prompt logprobs still hits


def test_preempted_sequences_keep_each_prompt_token_scored_once(default_model, prompts):
    ids, refs = prompts
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4
    # 34 blocks: the three 150-token prompts are admitted (10 blocks each), their 50 outputs (3 blocks more each) do
    # not fit beside them, so the newest get preempted and computed again (their prompt logprobs are not computed
    # twice)
    llm = LLM(str(default_model.weights), dtype="float32", kv_cache_memory=34 * block_bytes, max_num_batched_tokens=64)
    batch = [ids[3][:150], ids[3][150:], ids[3][::-1][:150]]
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, prompt_logprobs=2))
    assert llm.engine.stats().num_preemptions > 0
    assert_matches(batch[0], outs[0].prompt_logprobs, refs[3], 2)  # causal: the longer prompt's first 150 rows
    for prompt, out in zip(batch, outs):
        assert [lp.token_id for lp in out.prompt_logprobs[1:]] == prompt[1:] and out.prompt_logprobs[0] is None
    assert llm.engine.stats().num_free_kv_blocks == llm.engine.stats().num_kv_blocks


def test_n_samples_share_one_prompt_scoring(chunked, prompts):
    ids, refs = prompts
    out = chunked.generate([ids[2]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, prompt_logprobs=2))[0]
    assert len(out.outputs) == 3
    assert_matches(ids[2], out.prompt_logprobs, refs[2], 2)


def test_async_scheduling_scores_the_same(default_model, prompts):
    ids, refs = prompts
    llm = LLM(str(default_model.weights), dtype="float32", async_scheduling=True, max_num_batched_tokens=64)
    outs = llm.generate(ids[:2], SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=3))
    for prompt, out, ref in zip(ids, outs, refs):
        assert_matches(prompt, out.prompt_logprobs, ref, 3)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "2"])
def test_bad_prompt_logprobs_name_the_field(value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(prompt_logprobs=value)
    assert err.value.field == "prompt_logprobs"
