"""Multi-LoRA serving against transformers + PEFT: four adapters made by peft (different ranks, targets, rsLoRA,
rank/alpha patterns) and the base in the same steps; greedy output of every request equals the PeftModel's token for
token, and each adapter visibly changes the output. Also under the adapter cap, chunked prefill with preemption,
n > 1 forks, an FP8 KV cache, the prefix cache (never shared across adapters) and its KV events."""

from __future__ import annotations

import pytest
import torch

from lora_fixtures import (
    BLOCK, MAX_NEW, assert_greedy_within, generate, references, start_modules, tiny, tiny_engine,  # noqa: F401
)
from pagedserve.engine.kv_events import BlockStored
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.lora.config import LoraConfig
from pagedserve.engine.sampling_params import SamplingParams


def _engine(tiny, max_loras: int = 4, **fields) -> LLMEngine:
    return tiny_engine(tiny, LoraConfig(modules=start_modules(tiny), max_loras=max_loras, max_lora_rank=16), **fields)


def _record_adapters_per_step(engine: LLMEngine, monkeypatch) -> list[set]:
    seen: list[set] = []
    schedule = engine.scheduler.schedule

    def observed():
        out = schedule()
        seen.append({item.seq.adapter_name for item in out.scheduled})
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", observed)
    return seen


def test_four_adapters_and_the_base_in_the_same_steps_match_peft(tiny, monkeypatch):
    engine = _engine(tiny, max_loras=4)
    seen = _record_adapters_per_step(engine, monkeypatch)
    outputs = generate(engine, tiny["requests"])
    for i, expected in enumerate(tiny["expected"]):
        assert outputs[f"r{i}"] == [expected], tiny["requests"][i][0]
    assert len(seen[0]) == 5, "all four adapters and the base run in the first step"
    base = tiny["expected"][0]
    unchanged = [name for (name, ids), toks in zip(tiny["requests"], tiny["expected"])
                 if name is not None and ids == tiny["requests"][0][1] and toks == base]
    assert not unchanged, f"these adapters did not change the greedy output: {unchanged}"
    stats = engine.stats()
    assert stats.max_loras == 4 and stats.running_adapters == () and stats.num_free_kv_blocks == stats.num_kv_blocks


def test_the_adapter_cap_holds_per_step_and_everyone_finishes(tiny, monkeypatch):
    engine = _engine(tiny, max_loras=2)
    seen = _record_adapters_per_step(engine, monkeypatch)
    outputs = generate(engine, tiny["requests"])
    assert [outputs[f"r{i}"][0] for i in range(len(tiny["requests"]))] == tiny["expected"]
    assert max(len(s - {None}) for s in seen) == 2
    assert all(len(s - {None}) <= 2 for s in seen)


def test_chunked_prefill_and_preemption_with_adapters(tiny):
    # 7-token steps chunk every prompt; a cache of 4 blocks cannot hold all ten requests at once.
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
    engine = _engine(tiny, max_loras=3, max_num_batched_tokens=7, kv_cache_memory=4 * block_bytes)
    outputs = generate(engine, tiny["requests"])
    assert [outputs[f"r{i}"][0] for i in range(len(tiny["requests"]))] == tiny["expected"]
    assert engine.stats().num_preemptions > 0


def test_forks_of_an_adapter_request_keep_the_adapter(tiny):
    engine = _engine(tiny)
    adapter, ids = tiny["requests"][2]
    params = SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=MAX_NEW, min_tokens=MAX_NEW, seed=3)
    outputs = generate(engine, [(adapter, ids)], params)
    assert outputs["r0"] == [tiny["expected"][2]] * 2


def test_fp8_kv_cache_with_adapters(tiny):
    engine = _engine(tiny, kv_cache_dtype="fp8_e4m3")
    outputs = generate(engine, tiny["requests"])
    for i, (adapter, ids) in enumerate(tiny["requests"]):
        # test_quant_engine's stated FP8 agreement on logits (3 mantissa bits of K and V).
        assert_greedy_within(tiny["models"][adapter], ids, outputs[f"r{i}"][0], 0.3, (adapter, i))


def test_prefix_cache_is_never_shared_across_adapters(tiny):
    engine = _engine(tiny)
    engine.block_manager.record_events()
    prompt = tiny["requests"][-1][1]  # 30 tokens: one full block to share
    runs = [(None, prompt), ("full8", prompt), (None, prompt), ("full8", prompt), ("qv4", prompt)]
    cached = []
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    for i, (adapter, ids) in enumerate(runs):
        engine.add_request(f"p{i}", ids, params, adapter=adapter)
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        cached.append(final.metrics.num_cached_tokens)
        assert list(final.outputs[0].token_ids) == references(tiny["models"], [(adapter, ids)], MAX_NEW)[0]
    assert cached == [0, 0, BLOCK, BLOCK, 0]
    stored = [e for e in engine.block_manager.take_events() if isinstance(e, BlockStored)]
    ids = {info.name: info.adapter_id for info in engine.adapters()}
    assert {(e.lora_id, e.lora_name) for e in stored} == {(None, None), (ids["full8"], "full8"), (ids["qv4"], "qv4")}
    firsts = [e for e in stored if e.parent_hash is None]  # same tokens, three keys: base, full8, qv4
    assert len(firsts) == 3 and len({e.block_hash for e in firsts}) == 3
