"""Our Llama-family implementation against transformers on tiny random models of each architecture."""

from __future__ import annotations

import pytest
import torch

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
    "qwen2": ("Qwen2ForCausalLM", {}),
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
    import json

    path = make_tiny_model(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
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


def test_sliding_window_caps_the_context(tmp_path):
    path = make_tiny_model(tmp_path, "MistralForCausalLM", sliding_window=48)
    engine = LLM(str(path), dtype="float32").engine
    assert engine.max_model_len == 48
    with pytest.raises(Exception, match="context of 48"):
        engine.add_request("long", list(range(100, 140)), SamplingParams(max_tokens=20))
