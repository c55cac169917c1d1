"""The engine over an FP8 KV cache: twice the blocks of fp16 for the same memory (the point of the format), a context
that fp16 cannot hold served, and a checkpoint's own k/v scales installed with outputs that stay near transformers'."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine_probe

from pagedserve.engine import LLMEngine, EngineConfig, SamplingParams
from pagedserve.engine.errors import CapacityError
from pagedserve.kernels.kv_cache import KVCacheSpec, KVDtype
from pagedserve.kernels.kv_scales import CalibratingAttention


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


# E5M2 keeps 2 mantissa bits of K and V (relative error up to 2^-3): on the tiny random model (logits within
# +-0.8, std 0.16) the measured worst logit difference from transformers was 0.048; 0.15 is ~3x that.
FP8_CHECKPOINT_ATOL = 0.15


def engine(model_dir, **fields) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **fields))


# -- capacity --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_spec_gives_fp8_exactly_twice_the_blocks(fp8: KVDtype) -> None:
    """SmolLM2-135M geometry; any budget that is a whole number of fp16 blocks."""
    fp16 = KVCacheSpec(30, 3, 64, 16, KVDtype.FP16)
    eight = KVCacheSpec(30, 3, 64, 16, fp8)
    assert 2 * eight.bytes_per_block == fp16.bytes_per_block
    for blocks in (1, 7, 1000):
        memory = blocks * fp16.bytes_per_block
        assert eight.num_blocks_for(memory) == 2 * fp16.num_blocks_for(memory) == 2 * blocks


def test_engine_reports_twice_the_blocks_for_the_same_memory(tiny_llama) -> None:
    memory = 3 << 20
    fp16 = engine(tiny_llama, kv_cache_dtype="fp16", kv_cache_memory=memory).stats().num_kv_blocks
    fp8 = engine(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_cache_memory=memory).stats().num_kv_blocks
    assert fp16 > 0 and fp8 == 2 * fp16


def test_context_that_does_not_fit_in_fp16_fits_in_fp8(tiny_llama) -> None:
    spec = KVCacheSpec(2, 2, 16, 16, KVDtype.FP16)  # the tiny model's geometry
    memory = 4 * spec.bytes_per_block  # fp16: 4 blocks = 64 tokens; fp8: 128 tokens
    prompt, params = list(range(200, 270)), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    small = engine(tiny_llama, kv_cache_dtype="fp16", kv_cache_memory=memory, max_model_len=256)
    with pytest.raises(CapacityError):
        small.add_request("r", prompt, params)
    big = engine(tiny_llama, kv_cache_dtype="fp8_e4m3", kv_cache_memory=memory, max_model_len=256)
    big.add_request("r", prompt, params)
    outputs = []
    while big.has_unfinished_requests():
        outputs += big.step()
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 10


# -- checkpoint scales -------------------------------------------------------------------------------------

PREFIX = "model.layers.{}.self_attn."


def test_engine_uses_checkpoint_scales(tiny_llama, tmp_path, caplog, monkeypatch) -> None:
    """A checkpoint with compressed-tensors-style k_scale/v_scale tensors beside the weights: the engine installs
    them and its continuation's logits stay within FP8 E5M2's error of transformers' (on the same weights)."""
    folder = tmp_path / "with-scales"
    folder.mkdir()
    for item in tiny_llama.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    weights = load_file(str(folder / "model.safetensors"))
    for layer in range(2):
        weights[PREFIX.format(layer) + "k_scale"] = torch.tensor(0.03 + layer * 0.01)
        weights[PREFIX.format(layer) + "v_scale"] = torch.tensor(0.002)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        eng = engine(folder, kv_cache_dtype="fp8_e5m2", kv_cache_memory=1 << 20)
    assert "LOADED FROM CHECKPOINT (per-tensor, 2 layers)" in caplog.text
    assert not isinstance(eng.runner.attn_impl, CalibratingAttention)
    assert eng.runner.kv_cache.layers[1].k_scale.tolist() == pytest.approx([0.04, 0.04])
    run = engine_probe.ProbeRun()
    engine_probe.attach(eng, run, monkeypatch)
    engine_probe.generate(eng, {"r": [5, 6, 7, 300, 4000, 17, 99]}, 8, run)
    assert len(run.tokens["r"]) == 15
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    engine_probe.assert_matches(run, hf, atol=FP8_CHECKPOINT_ATOL)
