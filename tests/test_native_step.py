"""The native small-batch decode step (engine/runner/native_step.py, kernels/cpu/decode_step.c).

- Through the real engine on tiny random models (GQA ratios 4:2, 4:1, 4:4, head dims 16, 24 and 64, Qwen2's
  q/k/v bias, sliding windows, preemption; Gemma 3 with random (1 + w) norms, sliding and global layers on their own
  RoPE tables, linear RoPE scaling, softcapped logits): the logits of every position, the native step's included, equal
  transformers' full forward (fp32, atol 1e-4), and the greedy tokens equal transformers' generate.
- On the default model and on Gemma 3 270M, step by step on the same cache state: the native step's logits against
  the torch path's (fp32, bf16, FP8 and int8 KV caches), bounds stated per case.
- When it must not run: prefill/chunk in the step, more rows than the limit, the torch backend.
"""

from __future__ import annotations

import re

import pytest
import torch

import engine_probe
from conftest import make_tiny_model
from test_models import make_tiny_gemma
from pagedserve.engine import LLM, EngineConfig
from pagedserve.engine.errors import ConfigError

BLOCK = 8
TINY = {
    "llama-gqa2": ("LlamaForCausalLM", {}),
    "llama-mqa-d64": ("LlamaForCausalLM", {"hidden_size": 256, "num_key_value_heads": 1}),
    "llama-mha-d24": ("LlamaForCausalLM", {"hidden_size": 96, "num_key_value_heads": 4}),
    "qwen2-bias-sliding": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 12,
                                                "max_window_layers": 1}),
    "mistral-sliding": ("MistralForCausalLM", {"sliding_window": 2 * BLOCK + 3}),
    "gemma3-softcap": ("Gemma3ForCausalLM", "gemma3"),  # test_models.GEMMA_CASES
    "gemma3-legacy-config": ("Gemma3ForCausalLM", "gemma3-legacy-config"),
}


def _prompts(count: int) -> dict[str, list[int]]:
    return {f"s{i}": list(range(700 + 31 * i, 700 + 31 * i + 5 + 9 * i)) for i in range(count)}  # 5..68 tokens


@pytest.mark.parametrize("preempt", [False, True], ids=["roomy", "preempting"])
@pytest.mark.parametrize("case", sorted(TINY))
def test_native_step_matches_transformers(tmp_path, monkeypatch, case, preempt):
    import transformers

    arch, overrides = TINY[case]
    if isinstance(overrides, str):
        path = make_tiny_gemma(tmp_path, overrides)
    else:
        path = make_tiny_model(tmp_path, arch, initializer_range=0.1, **overrides)
    hf = getattr(transformers, arch).from_pretrained(str(path), dtype=torch.float32).eval()
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 2 * cfg.num_hidden_layers * BLOCK * cfg.num_key_value_heads * head_dim * 4
    blocks = 12 if preempt else 256
    engine = LLM(str(path), dtype="float32", block_size=BLOCK, kv_cache_memory=blocks * block_bytes,
                 native_step_max_batch=8).engine
    assert engine.runner.native_step is not None
    run = engine_probe.ProbeRun()
    engine_probe.attach(engine, run, monkeypatch)
    prompts = _prompts(6)
    engine_probe.generate(engine, prompts, 20, run)
    assert run.native_steps >= 10
    assert (engine.stats().num_preemptions > 0) == preempt
    engine_probe.assert_matches(run, hf)
    for request_id, prompt in prompts.items():
        assert run.tokens[request_id][len(prompt):] == engine_probe.hf_greedy_tokens(hf, prompt, 20), request_id


def _lockstep(engine, prompts: dict[str, list[int]], steps: int) -> list[float]:
    """Greedy decode; each native-eligible step runs the native step, then the torch path on the same cache state
    (both write the new token's K/V into the same slots). Returns per step max|native - torch| / max|torch|."""
    from pagedserve.engine import SamplingParams

    runner = engine.runner
    native_step, forward = runner.native_step, runner.forward
    errors: list[float] = []

    def both(batch):
        if not native_step.accepts(batch):
            return forward(batch)
        native_logits = native_step.run(runner.prepare(batch))
        runner.native_step = None
        try:
            result = forward(batch)
        finally:
            runner.native_step = native_step
        errors.append(((native_logits - result[0]).abs().max() / result[0].abs().max()).item())
        return result

    runner.forward = both
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return errors


# Relative bounds on max|logit difference| / max|logit|. fp32: the two paths differ only in summation order.
# bf16: the torch path rounds the hidden state, norms, RoPE, q/k/v and attention output to bf16 in every layer,
# the native step keeps them fp32, so they differ by a few bf16 roundings (2^-8 each) compounded over 30 layers
# (measured: 1.3% median, 1.7% max on Sapphire Rapids).
# FP8 KV in fp32: the FP8 rounding itself is torch's, bit for bit, but a new K/V element within fp32 rounding of
# an FP8 rounding boundary lands on the neighbouring FP8 value in one path (an element off by 2^-3 / 2^-2 of
# itself; 1-7 of the ~17k new K/V elements of a 3-row step, seen): up to ~2e-3 on such steps, ~1e-6 on others.
# int8 KV likewise: an element within fp32 rounding of a half-step lands one int8 step (1/127 of its row's amax)
# away in one path.
BOUNDS = {("float32", "auto"): 1e-4, ("bfloat16", "auto"): 0.05, ("float32", "fp8_e4m3"): 1e-2,
          ("float32", "fp8_e5m2"): 1e-2, ("bfloat16", "fp8_e4m3"): 0.1, ("float32", "int8"): 1e-2,
          ("bfloat16", "int8"): 0.1}
# Gemma 3 270M: one KV head of 256 over 18 layers, so one flipped int8 / FP8 element early in the stack moves the
# K/V rows of every later layer by more than fp32 rounding and flips more of theirs (seen: the first 5 layers'
# bytes identical, then 4, then 23-120 elements differing per layer). Measured on Zen 5 at the avx512_bf16, avx2
# and portable tiers: fp32 1.7e-6, bf16 2.7e-2, fp32 int8 2.7e-2, fp32 FP8 E4M3 1.1e-2 at most; a wrong norm, RoPE
# table or row store moves the logits by O(1).
GEMMA_BOUNDS = {("float32", "auto"): 1e-4, ("bfloat16", "auto"): 0.05, ("float32", "int8"): 0.1,
                ("float32", "fp8_e4m3"): 0.1}


@pytest.mark.parametrize("dtype,kv", sorted(BOUNDS))
def test_native_logits_track_the_torch_path_on_the_default_model(default_model, dtype, kv):
    engine = LLM(str(default_model.weights), dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=64 << 20,
                 enable_prefix_caching=False, native_step_max_batch=8).engine
    errors = _lockstep(engine, _prompts(3), 12)
    assert len(errors) >= 10
    assert max(errors) <= BOUNDS[dtype, kv], errors


@pytest.mark.parametrize("dtype,kv", sorted(GEMMA_BOUNDS))
def test_native_logits_track_the_torch_path_on_gemma3(dtype, kv):
    engine = LLM("gemma-3-270m", dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=64 << 20,
                 enable_prefix_caching=False, native_step_max_batch=8).engine
    errors = _lockstep(engine, _prompts(3), 12)
    assert len(errors) >= 10
    assert max(errors) <= GEMMA_BOUNDS[dtype, kv], errors


def test_decided_per_step_from_the_schedule(tmp_path, monkeypatch):
    """Five sequences with a limit of 2 rows: no native step until only two decode; a prompt arriving mid-way puts
    its prefill step (and its chunks) back on the torch path."""
    from pagedserve.engine import SamplingParams

    path = make_tiny_model(tmp_path, initializer_range=0.1)
    engine = LLM(str(path), dtype="float32", block_size=BLOCK, native_step_max_batch=2,
                 max_num_batched_tokens=16).engine
    seen: list[tuple[int, bool]] = []
    execute = engine.runner.execute

    def spy(batch):
        decode_only = all(i.num_new_tokens == 1 and i.seq.num_computed_tokens + 1 == i.seq.num_tokens
                          for i in batch.scheduled)
        seen.append((len(batch.scheduled), decode_only, engine.runner.native_step.accepts(batch)))
        return execute(batch)

    monkeypatch.setattr(engine.runner, "execute", spy)
    for i, prompt in enumerate(_prompts(5).values()):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=4 + 6 * i, ignore_eos=True))
    for _ in range(12):
        engine.step()
    engine.add_request("late", list(range(900, 940)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert all(accepted == (rows <= 2 and decode_only) for rows, decode_only, accepted in seen)
    assert any(accepted for *_, accepted in seen) and any(rows > 2 and decode_only for rows, decode_only, _ in seen)


def test_stays_off_where_it_does_not_apply(tmp_path):
    llama = make_tiny_model(tmp_path / "llama")
    assert LLM(str(llama), dtype="float32", native_step_max_batch=0).engine.runner.native_step is None
    assert LLM(str(llama), dtype="float32", attention_backend="torch").engine.runner.native_step is None


def test_a_bad_stack_names_what_is_wrong(tmp_path):
    import dataclasses

    from pagedserve.engine.models.decoder_stack import DecoderStack, StackLayer

    model = LLM(str(make_tiny_gemma(tmp_path, "gemma3")), dtype="float32").engine.runner.model
    stack = model.decoder_stack()
    assert isinstance(stack, DecoderStack) and stack.activation == "gelu_tanh" and stack.logit_softcap > 0
    layer = stack.layers[0]
    with pytest.raises(ValueError, match="attn_out_norm and mlp_out_norm"):
        dataclasses.replace(layer, mlp_out_norm=None)
    with pytest.raises(ValueError, match="cos and signed_sin"):
        dataclasses.replace(layer, cos=stack.cos, signed_sin=None)
    short_table = dataclasses.replace(layer, cos=stack.cos[:4], signed_sin=stack.signed_sin[:4])
    cases = {
        "activation 'relu'; supported: silu, gelu_tanh": {"activation": "relu"},
        "logit_softcap 0.0 must be positive": {"logit_softcap": 0.0},
        "final norm's dtype": {"final_norm": stack.final_norm.to(torch.bfloat16)},
        "RoPE table must be fp32 in the stack's table shape": {"layers": (short_table, *stack.layers[1:])},
    }
    for message, change in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            dataclasses.replace(stack, **change)
    assert isinstance(layer, StackLayer)


def test_bad_limit_names_the_field():
    with pytest.raises(ConfigError, match="native_step_max_batch"):
        EngineConfig(native_step_max_batch=-1)
