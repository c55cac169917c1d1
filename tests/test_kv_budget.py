"""--gpu-memory-utilization's KV cache sizing (engine/runner/kv_budget.py) and the full-size step it profiles
(engine/runner/profile_step.py).

The profiled step is a real forward: its probabilities equal transformers' softmax on the same prompts (the last
token of each prompt, then earlier ones), through the engine's own attention, sliding windows included, and it
never writes the engine's cache. The share's arithmetic is checked on device readings of an 80 GiB card; on CUDA
the readings come from the device itself (tests/gpu/e2e_check.py's memory_utilization case)."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from conftest import PRODUCT_KV_CACHE_MEMORY, TEST_KV_CACHE_MEMORY, make_tiny_model

from pagedserve.engine import LLM
from pagedserve.engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from pagedserve.engine.errors import ConfigError
from pagedserve.engine.runner.kv_budget import DeviceMemory, StepMemory, kv_bytes_for_share, kv_cache_bytes
from pagedserve.engine.runner.profile_step import ProfileShape, ProfileTarget, run_profile_step, scratch_cache

GIB = 2**30


@pytest.mark.parametrize(("limits", "prompt_lens", "rows"), [
    ((2048, 512, 256), (512,) * 4, 256),  # long steps: full-length prompts
    ((2048, 4096, 256), (2048,), 256),  # one prompt as long as the step
    ((100, 30, 2), (30, 30), 2),  # two sequences at most: the scheduler never forms more tokens than they hold
    ((1000, 300, 8), (300, 300, 300, 100), 8),
    ((5, 512, 256), (5,), 5),  # rows never exceed tokens
])
def test_the_profiled_step_is_the_largest_the_scheduler_can_form(limits, prompt_lens, rows):
    shape = ProfileShape.largest(*limits)
    assert shape.prompt_lens == prompt_lens and shape.logits_rows == rows


@pytest.mark.parametrize("case", ["llama", "mistral-sliding"])
def test_the_profiled_step_is_a_real_forward(tmp_path, case):
    overrides = {"sliding_window": 24, "initializer_range": 0.1} if case == "mistral-sliding" else {}
    architecture = "MistralForCausalLM" if case == "mistral-sliding" else "LlamaForCausalLM"
    path = make_tiny_model(tmp_path, architecture, **overrides)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20)
    runner = llm.engine.runner
    shape = ProfileShape(prompt_lens=(40, 7, 19), logits_rows=6)  # 3 prompts' last tokens, then 3 of the first's
    before = [layer.k.clone() for layer in runner.kv_cache.layers]
    target = ProfileTarget(runner.model, runner.attn_impl, runner.layer_ops, runner.windows)
    probs = run_profile_step(target, scratch_cache(runner.kv_spec, shape, runner.device), shape, runner.vocab_size)
    assert all(torch.equal(a, layer.k) for a, layer in zip(before, runner.kv_cache.layers))

    reference = getattr(transformers, architecture).from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.arange(sum(shape.prompt_lens)) % runner.vocab_size
    prompts = ids.split(list(shape.prompt_lens))
    with torch.no_grad():
        logits = [reference(p[None]).logits[0].float() for p in prompts]
    expected = torch.stack([logits[0][-1], logits[1][-1], logits[2][-1], logits[0][0], logits[0][1], logits[0][2]])
    # Log-probabilities: a 49152-token vocabulary's probabilities are ~2e-5 each, too small to compare directly.
    torch.testing.assert_close(probs.log(), torch.log_softmax(expected, dim=-1), atol=1e-4, rtol=1e-4)


def _reading(total=80, free=60.0, allocated=16.0, reserved=17.0) -> DeviceMemory:
    return DeviceMemory(int(total * GIB), int(free * GIB), int(allocated * GIB), int(reserved * GIB))


# 16 GiB of weights, a 0.25 GiB scratch cache, a step peaking 2 GiB above it and growing cuBLAS's workspace by
# 0.1 GiB outside torch (free fell 0.6 GiB while torch's reserve grew 0.5 GiB).
STEP = StepMemory(before_cache=_reading(free=60.25), before_step=_reading(free=60.0, allocated=16.25, reserved=17.25),
                  after_step=_reading(free=59.4, allocated=16.3, reserved=17.75), peak_allocated=int(18.25 * GIB))


def test_the_share_leaves_the_cache_what_weights_and_a_step_do_not_take():
    assert STEP.activations == 2 * GIB and STEP.outside_torch == pytest.approx(0.1 * GIB, abs=1)
    assert STEP.held_without_cache == pytest.approx(18.1 * GIB, abs=1)
    assert kv_bytes_for_share(0.9, STEP, free_now=60 * GIB) == pytest.approx((72 - 18.1) * GIB, abs=1)
    assert kv_bytes_for_share(0.5, STEP, free_now=60 * GIB) == pytest.approx((40 - 18.1) * GIB, abs=1)


def test_a_share_with_nothing_left_or_more_than_is_free_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization 0.2 allows 16.00 GiB .* take 18.10 GiB"):
        kv_bytes_for_share(0.2, STEP, free_now=60 * GIB)
    with pytest.raises(ConfigError, match=r"leaves 53.90 GiB for the KV cache, but only 30.00 GiB .* is free"):
        kv_bytes_for_share(0.9, STEP, free_now=30 * GIB)


def _never_profiled() -> StepMemory:
    raise AssertionError("the step is profiled only on CUDA with --gpu-memory-utilization and no --kv-cache-memory")


def test_which_rule_sizes_the_cache(caplog):
    cpu = torch.device("cpu")
    assert kv_cache_bytes(EngineConfig(), cpu, _never_profiled) == DEFAULT_KV_CACHE_MEMORY
    given = EngineConfig(kv_cache_memory=64 << 20, gpu_memory_utilization=0.9)
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.runner.kv_budget"):
        assert kv_cache_bytes(given, torch.device("cuda"), _never_profiled) == 64 << 20  # as vLLM: bytes win
        assert kv_cache_bytes(EngineConfig(gpu_memory_utilization=0.9), cpu, _never_profiled) == \
            DEFAULT_KV_CACHE_MEMORY
    assert "--gpu-memory-utilization 0.9 is not used" in caplog.text
    assert "--gpu-memory-utilization has no effect on cpu" in caplog.text


def test_the_product_default_is_the_documented_gib():
    # tests/conftest.py gives in-process test engines a smaller default; the product's stays what docs/gpu.md says
    assert PRODUCT_KV_CACHE_MEMORY == 1 << 30 and DEFAULT_KV_CACHE_MEMORY == TEST_KV_CACHE_MEMORY


@pytest.mark.parametrize("value", [0, -0.1, 1.01, True, "0.9"])
def test_a_share_outside_zero_to_one_is_refused(value):
    with pytest.raises(ConfigError, match="gpu_memory_utilization: must be in"):
        EngineConfig(gpu_memory_utilization=value)
