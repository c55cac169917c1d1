"""Our Llama-family implementation against transformers on tiny random models of each architecture."""

from __future__ import annotations

import json

import pytest
import torch

import engine_probe
from conftest import make_tiny_model
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.errors import ModelLoadError

CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "LlamaForCausalLM",
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}, "rope_theta": 500000.0},
    ),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "mistral-sliding": ("MistralForCausalLM", {"sliding_window": 24, "initializer_range": 0.1}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen2-sliding": (
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1, "initializer_range": 0.1},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_model_greedy_matches_transformers(tmp_path, case):
    import transformers

    arch, overrides = CASES[case]
    path = make_tiny_model(tmp_path, arch, **overrides)
    hf = getattr(transformers, arch).from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = [[5, 17, 300, 42, 9000, 11], list(range(1000, 1100))]
    llm = LLM(str(path), dtype="float32", block_size=16, max_num_batched_tokens=40)  # chunked prefill too
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert list(out.outputs[0].token_ids) == ref[0, len(prompt):].tolist()


def test_qwen2_has_qkv_bias_and_no_o_bias(tmp_path):
    path = make_tiny_model(tmp_path, "Qwen2ForCausalLM")
    attn = LLM(str(path), dtype="float32").engine.loaded.model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None  # q/k/v fused after loading


def test_unsupported_architecture_lists_supported(tmp_path):
    path = make_tiny_model(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    supported = ("Gemma3ForCausalLM, Gemma3ForConditionalGeneration, LlamaForCausalLM, MistralForCausalLM, "
                 "MixtralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM ")
    named = r"architectures: \['GPT2LMHeadModel'\] unsupported; supported: "
    with pytest.raises(ModelLoadError, match=named + supported):
        LLM(str(path))


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_model(tmp_path)
    weights = load_file(str(path / "model.safetensors"))
    broken = dict(weights)
    del broken["model.layers.1.mlp.up_proj.weight"]
    save_file(broken, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        LLM(str(path))
    broken = dict(weights)
    broken["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(broken, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="k_proj.weight: shape"):
        LLM(str(path))


def test_sliding_window_no_longer_caps_the_context(tmp_path):
    path = make_tiny_model(tmp_path, "MistralForCausalLM", sliding_window=48)
    engine = LLM(str(path), dtype="float32").engine
    assert engine.max_model_len == 512 and engine.runner.windows == (48,)
    assert engine.block_manager.window == 48  # every layer slides: blocks behind the window are freed


# -- Gemma 3 and sliding windows through the paged engine ------------------------------------------------------
BLOCK = 8
SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA_CASES = {
    # transformers 5's config: rope_parameters per layer type (linear scaling on the global layers), window < block
    "gemma3": dict(
        sliding_window=6, layer_types=[SLIDING, FULL, SLIDING, SLIDING], final_logit_softcapping=2.0,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                         FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}},
    ),
    # the keys Gemma 3 checkpoints on the Hub carry: rope_theta/rope_scaling/rope_local_base_freq and a pattern
    "gemma3-legacy-config": dict(sliding_window=2 * BLOCK),
}
LEGACY_KEYS = {
    "rope_theta": 50000.0, "rope_local_base_freq": 5000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "sliding_window_pattern": 2,
}


def make_tiny_gemma(path, case: str):
    from safetensors.torch import load_file, save_file

    make_tiny_model(path, "Gemma3ForCausalLM", num_hidden_layers=4, head_dim=16, tie_word_embeddings=True,
                    query_pre_attn_scalar=24, initializer_range=0.1, **GEMMA_CASES[case])
    # Random norm weights: transformers initializes them to 0, which would hide a missing (1 + weight).
    weights = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = torch.randn(tensor.shape, generator=gen) * 0.5
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    if case == "gemma3-legacy-config":
        cfg = json.loads((path / "config.json").read_text())
        for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
            cfg.pop(key, None)
        (path / "config.json").write_text(json.dumps({**cfg, **LEGACY_KEYS}))
    return path


def run_engine_vs_transformers(path, arch: str, backend: str, kv_blocks: int, monkeypatch,
                               new_tokens: int = 16) -> LLM:
    """Prompts sharing a 3-block prefix, a cache too small for all of them (preemption), 11-token steps (prefill
    chunks crossing window edges): logits at every computed position and greedy tokens equal transformers'.
    Without a sliding window a prompt starts only when all of it fits, so the preemption comes from decoding
    sequences outgrowing the cache: `new_tokens` must be long enough for that."""
    import transformers

    hf = getattr(transformers, arch).from_pretrained(str(path), dtype=torch.float32).eval()
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 2 * cfg.num_hidden_layers * BLOCK * cfg.num_key_value_heads * head_dim * 4  # K and V, fp32
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=11, attention_backend=backend,
              kv_cache_memory=kv_blocks * block_bytes)
    engine = llm.engine
    run = engine_probe.ProbeRun()
    engine_probe.attach(engine, run, monkeypatch)
    prefix = list(range(300, 300 + 3 * BLOCK))
    prompts = {f"p{i}": prefix + list(range(1000 + 50 * i, 1007 + 55 * i)) for i in range(4)}
    engine_probe.generate(engine, {"p0": prompts["p0"]}, new_tokens, run)  # warms the prefix cache
    engine_probe.generate(engine, {k: v for k, v in prompts.items() if k != "p0"}, new_tokens, run)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and run.cached["p1"] == len(prefix)  # p0's blocks were all still cached
    assert stats.num_free_kv_blocks == stats.num_kv_blocks  # nothing leaked, FREED entries included
    engine_probe.assert_matches(run, hf)
    for request_id, prompt in prompts.items():
        assert run.tokens[request_id][len(prompt):] == engine_probe.hf_greedy_tokens(hf, prompt, new_tokens), \
            request_id
    return llm


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("case", sorted(GEMMA_CASES))
def test_gemma3_matches_transformers_through_the_paged_engine(tmp_path, monkeypatch, case, backend):
    path = make_tiny_gemma(tmp_path, case)
    llm = run_engine_vs_transformers(path, "Gemma3ForCausalLM", backend, 12, monkeypatch, new_tokens=32)
    args = llm.engine.runner.model.args
    assert None in args.layer_windows and len(set(args.layer_windows)) == 2  # global and sliding layers
    assert llm.engine.block_manager.window is None  # global layers need every block: nothing is freed


def test_gemma3_window_changes_transformers_output(tmp_path):
    """Guards the comparisons above: with these prompts the window really changes transformers' logits."""
    import transformers

    path = make_tiny_gemma(tmp_path, "gemma3")
    ids = torch.tensor([list(range(300, 340))])
    with torch.inference_mode():
        sliding = transformers.Gemma3ForCausalLM.from_pretrained(str(path), dtype=torch.float32)(ids).logits
        full = transformers.Gemma3ForCausalLM.from_pretrained(str(path), dtype=torch.float32, sliding_window=4096)
        full = full(ids).logits
    assert (sliding - full).abs().max().item() > 1e-2


def test_gemma3_config_errors_name_the_field(tmp_path):
    path = make_tiny_gemma(tmp_path, "gemma3")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "attn_logit_softcapping": 50.0}))
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        LLM(str(path))
    (path / "config.json").write_text(json.dumps({**cfg, "layer_types": [SLIDING, "chunked_attention"] * 2}))
    with pytest.raises(ModelLoadError, match="layer_types"):
        LLM(str(path))


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_all_sliding_model_matches_transformers_with_preemption_and_prefix_hits(tmp_path, monkeypatch, backend):
    path = make_tiny_model(tmp_path, "MistralForCausalLM", sliding_window=2 * BLOCK, initializer_range=0.1)
    llm = run_engine_vs_transformers(path, "MistralForCausalLM", backend, 8, monkeypatch)
    assert llm.engine.block_manager.window == 2 * BLOCK


@pytest.mark.parametrize("window", [2 * BLOCK, BLOCK + 3])
def test_all_sliding_model_holds_only_the_window_blocks(tmp_path, monkeypatch, window):
    """A sequence 5x longer than the window keeps at most ceil(window / block) + 1 blocks while it decodes, and its
    output still equals transformers'."""
    import transformers

    path = make_tiny_model(tmp_path, "MistralForCausalLM", sliding_window=window, initializer_range=0.1)
    hf = transformers.MistralForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    engine = LLM(str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=11).engine
    run = engine_probe.ProbeRun()
    engine_probe.attach(engine, run, monkeypatch)
    prompt = list(range(500, 530))
    new_tokens = 5 * window - len(prompt)
    engine_probe.generate(engine, {"long": prompt}, new_tokens, run)
    held = run.held_blocks["long"]
    assert len(held) >= new_tokens - 2 and max(held) <= -(-window // BLOCK) + 1  # every decode step but the last
    engine_probe.assert_matches(run, hf)
    assert run.tokens["long"][len(prompt):] == engine_probe.hf_greedy_tokens(hf, prompt, new_tokens)


def test_gemma3_bf16_native_path_tracks_transformers(tmp_path, monkeypatch):
    """bf16 on CPU (native attention and layer ops, the default there): every position's logits stay as close to
    transformers' fp32 ones as transformers' own bf16 forward does, and every greedy token is the fp32 argmax up to
    that same bf16 error. (Not "equal to transformers' bf16 generate": on this random model its bf16 logits tie at
    the first generated token, 1.9062 twice, where the fp32 ones differ by 0.01; its pick is as arbitrary as ours.)"""
    import transformers

    path = make_tiny_gemma(tmp_path, "gemma3")
    engine = LLM(str(path), dtype="bfloat16", block_size=BLOCK, max_num_batched_tokens=11).engine
    assert type(engine.runner.layer_ops).__name__ == "NativeLayerOps"
    run = engine_probe.ProbeRun()
    engine_probe.attach(engine, run, monkeypatch)
    prompt = list(range(300, 340))
    engine_probe.generate(engine, {"a": prompt}, 10, run)
    tokens = torch.tensor([run.tokens["a"]])
    hf = {dtype: transformers.Gemma3ForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
          for dtype in (torch.float32, torch.bfloat16)}
    with torch.inference_mode():
        exact, theirs = (hf[dtype](tokens).logits[0].float() for dtype in (torch.float32, torch.bfloat16))
    ours = max((logits - exact[p]).abs().max().item() for p, logits in run.logits["a"])
    bf16_error = (theirs - exact).abs().max().item()
    assert ours <= 1.25 * bf16_error
    for p in range(len(prompt) - 1, len(run.tokens["a"]) - 1):
        picked = run.tokens["a"][p + 1]
        assert exact[p, picked] >= exact[p].max() - bf16_error, f"position {p}: token {picked} is not a greedy pick"


def test_all_sliding_model_serves_a_sequence_longer_than_the_kv_cache(tmp_path, monkeypatch):
    """6 blocks of 8 tokens hold 48 tokens; a 90-token sequence still runs (a step needs at most
    ceil((window - 1 + 11) / 8) + 1 = 5 blocks), with transformers' output. Without the window it is refused."""
    import transformers

    from pagedserve.engine.errors import CapacityError

    window = 2 * BLOCK
    path = make_tiny_model(tmp_path, "MistralForCausalLM", sliding_window=window, initializer_range=0.1)
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, fp32
    engine = LLM(str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=11,
                 kv_cache_memory=6 * block_bytes).engine
    assert engine.block_manager.num_blocks == 6
    run = engine_probe.ProbeRun()
    engine_probe.attach(engine, run, monkeypatch)
    prompt = list(range(500, 530))
    engine_probe.generate(engine, {"long": prompt}, 60, run)
    hf = transformers.MistralForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    engine_probe.assert_matches(run, hf)
    assert run.tokens["long"][len(prompt):] == engine_probe.hf_greedy_tokens(hf, prompt, 60)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
    full = LLM(str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=11, kv_cache_memory=6 * block_bytes)
    with pytest.raises(CapacityError, match="whole KV cache"):
        full.engine.add_request("long", prompt, SamplingParams(max_tokens=60))
