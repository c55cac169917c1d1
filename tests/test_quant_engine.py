"""GPTQ, AWQ and GGUF checkpoints through the whole paged engine (a KV cache too small for every prompt, so the
newest are preempted and recomputed; 7-token steps, so prompts prefill in chunks), over whole 24-token greedy
continuations of several prompts, against transformers running the same dequantized weights: the logits of every
position the engine computes, and the greedy tokens. The default cache must agree to float32 summation order; the
FP8 cache within the agreement stated at FP8_ATOL."""

from __future__ import annotations

import pytest
import torch

import engine_probe
from conftest import hf_from_gguf
from gguf_fixtures import write_tiny_llama
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from quant_fixtures import FIXTURE_NAMES, dequantized_reference, fixture_dir, grouped_logits_atol

MAX_NEW = 24
BLOCK = 8  # small blocks, so a decode outgrows the one block to spare each sequence is admitted with
# The default (fp32) cache: the same weights and math as transformers, summed in another order (with int16
# activations in the VNNI build's grouped linears: quant_fixtures.grouped_logits_atol).
# An FP8 E4M3 cache keeps 3 mantissa bits of every K and V (relative error up to 2^-4) under per-head scales
# fixed on the first prefill: the worst logit difference measured over these 8 checkpoints' continuations was
# 0.087-0.18 (logits span about +-2.5). Since the default cache matches transformers to grouped_logits_atol(), this is also
# the agreement with the float32-cache run.
FP8_ATOL = 0.3
# The cache's bytes in float32 blocks of BLOCK tokens, per KV dtype: an FP8 block takes a quarter of the bytes.
KV_BLOCKS = {"auto": 8, "fp8_e4m3": 4}


def _engine(path, hf, kv_cache_dtype: str, kv_blocks: int) -> LLMEngine:
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 2 * cfg.num_hidden_layers * BLOCK * cfg.num_key_value_heads * head_dim * 4  # K and V, float32
    return LLMEngine(EngineConfig(
        model=str(path), dtype="float32", kv_cache_dtype=kv_cache_dtype, block_size=BLOCK,
        kv_cache_memory=kv_blocks * block_bytes, max_num_batched_tokens=7,
        lm_head_quantization="none"))  # the head as stored, as transformers' reference multiplies it


def run_and_compare(path, hf, prompts: dict[str, list[int]], kv_cache_dtype: str, kv_blocks: int, monkeypatch):
    engine = _engine(path, hf, kv_cache_dtype, kv_blocks)
    run = engine_probe.ProbeRun()
    engine_probe.attach(engine, run, monkeypatch)
    engine_probe.generate(engine, prompts, MAX_NEW, run)
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the cache was meant to be too small for every prompt at once"
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert all(len(run.tokens[r]) == len(p) + MAX_NEW for r, p in prompts.items())
    atol = grouped_logits_atol() if kv_cache_dtype == "auto" else FP8_ATOL
    engine_probe.assert_matches(run, hf, atol=atol)
    _assert_greedy(run, hf, prompts, atol)
    return run


def _assert_greedy(run, hf, prompts: dict[str, list[int]], atol: float) -> None:
    """Each generated token is the reference's argmax after the engine's own prefix (wherever the reference's
    best two logits are further apart than the logits may differ): the greedy continuation, token by token."""
    for request_id, prompt in prompts.items():
        tokens = run.tokens[request_id]
        with torch.inference_mode():
            reference = hf(torch.tensor([tokens])).logits[0].float()
        for position in range(len(prompt) - 1, len(tokens) - 1):
            best = reference[position].topk(2)
            if (best.values[0] - best.values[1]).item() > 2 * atol:
                assert tokens[position + 1] == best.indices[0].item(), (request_id, position)


def _prompts(vocab: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    return {f"p{i}": torch.randint(3, vocab, (length,), generator=g).tolist() for i, length in enumerate((9, 23, 40))}


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_tool_checkpoint_through_the_paged_engine(name, kv_cache_dtype, references, monkeypatch):
    path = fixture_dir(name)
    if name not in references:
        references[name] = dequantized_reference(name)
    hf = references[name]
    prompts = _prompts(hf.config.vocab_size)
    # The 3 prompts need 19 blocks at once; 8 hold any one of them (4 float32 blocks' bytes are 16 FP8 blocks). A
    # prompt starts only when all of it fits with a block to spare per running sequence, so the preemption is a
    # decoding sequence outgrowing the cache (admission_replay.py's replay of these lengths: one in either cache).
    run_and_compare(path, hf, prompts, kv_cache_dtype, KV_BLOCKS[kv_cache_dtype], monkeypatch)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("quant-engine-gguf") / "tiny-llama.gguf")
    return path, hf_from_gguf(path)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_gguf_checkpoint_through_the_paged_engine(tiny_gguf, kv_cache_dtype, monkeypatch):
    """Every GGUF block type the tiny file mixes (Q4_0 ... Q6_K, BF16), dequantized by transformers' GGUF loader
    for the reference."""
    path, hf = tiny_gguf
    prompts = _prompts(hf.config.vocab_size)
    run_and_compare(path, hf, prompts, kv_cache_dtype, KV_BLOCKS[kv_cache_dtype], monkeypatch)
