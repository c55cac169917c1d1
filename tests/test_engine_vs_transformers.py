"""Greedy output of the engine equals transformers' generate (fp32), token for token, under every scheduling regime."""

from __future__ import annotations

import pytest

from conftest import hf_greedy_batch
from pagedserve.engine import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "Write a haiku about the ocean.",
    "The three primary colors are",
    "Translate to French: Good morning, how are you?",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "In 1492, Christopher Columbus",
    "Photosynthesis is the process by which plants",
    "Q: What is the boiling point of water?\nA:",
    "import numpy as np\n",
    "My favourite recipe for pancakes needs",
    "The theory of relativity states that",
    "Dear hiring manager, I am writing to",
    "Les Misérables est un roman de",
    "日本の首都は",
    "The best way to learn a programming language is to practice by writing many small programs every day, because",
    "Roses are red,",
    "SELECT name FROM users WHERE",
    "A list of prime numbers: 2, 3, 5, 7,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
MAX_NEW = 24
SHARED_PREFIX = (
    "You are a careful assistant. Answer briefly and precisely, using plain English and no lists. "
    "Think about units, names and dates before you answer. The question follows. "
)


@pytest.fixture(scope="module")
def references(hf_reference):
    model, tok = hf_reference
    ids = [tok.encode(p) for p in PROMPTS]
    return ids, hf_greedy_batch(model, ids, MAX_NEW)


@pytest.fixture(scope="module")
def prefix_references(hf_reference):
    model, tok = hf_reference
    ids = [tok.encode(SHARED_PREFIX + p) for p in PROMPTS[:8]]
    return ids, hf_greedy_batch(model, ids, MAX_NEW)


def _run(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompt_ids, params)]


def _assert_same(ours, theirs):
    mismatched = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert not mismatched, f"prompts {mismatched} differ from transformers: {[(ours[i], theirs[i]) for i in mismatched]}"


def test_all_at_once_matches_transformers(references, default_model):
    ids, expected = references
    llm = LLM(str(default_model.weights), dtype="float32")
    _assert_same(_run(llm, ids), expected)
    stats = llm.engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks  # nothing leaked


def test_preemption_keeps_outputs(references, default_model):
    ids, expected = references
    # 24 blocks of 16 tokens: far less than 22 concurrent sequences need, so the newest get preempted.
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4
    llm = LLM(str(default_model.weights), dtype="float32", kv_cache_memory=24 * block_bytes)
    _assert_same(_run(llm, ids), expected)
    assert llm.engine.stats().num_preemptions > 0


def test_chunked_prefill_keeps_outputs(references, default_model):
    ids, expected = references
    # vLLM's long_prefill_token_threshold below the budget: chunks of 5, two prompts' chunks sharing a step
    llm = LLM(str(default_model.weights), dtype="float32", max_num_batched_tokens=7, enable_prefix_caching=False,
              long_prefill_token_threshold=5)
    assert max(len(p) for p in ids) > 7  # every long prompt is split across steps
    _assert_same(_run(llm, ids), expected)


def test_shared_prefix_hits_cache_and_keeps_outputs(prefix_references, default_model):
    ids, expected = prefix_references
    llm = LLM(str(default_model.weights), dtype="float32")
    first = _run(llm, ids[:1])  # warms the cache with the shared prefix
    rest = _run(llm, ids[1:])
    _assert_same(first + rest, expected)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.prefix_cache_hits >= (len(ids) - 1) * (len(SHARED_PREFIX) // 8 // 16) * 16
