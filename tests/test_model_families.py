"""Qwen3 (dense and MoE), Phi-3 / Phi-4-mini and Gemma 3 (multimodal checkpoints) against transformers' fp32 greedy
generate on tiny random models of each layout (tests/family_fixtures.py): through the paged engine with chunked
prefill and preemption, from a GGUF written from the same weights, and from GPTQ/AWQ checkpoints of them."""

from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

import engine_probe
from family_fixtures import CASES, ORIGINAL, hf_model, make_family_model, write_gguf, write_group_quant
from pagedserve.engine import LLM, SamplingParams

BLOCK, NEW_TOKENS = 16, 16
_gen = torch.Generator().manual_seed(7)
# Seven short prompts and one past the 2048-token pretraining length, where LongRoPE switches to its long factors
# and Phi-3-mini's 2047-token window starts dropping keys.
PROMPTS = {f"p{i}": torch.randint(100, 49000, (n,), generator=_gen).tolist()
           for i, n in enumerate((1, 3, 7, 16, 33, 64, 120, ORIGINAL + 52))}
LONG = f"p{len(PROMPTS) - 1}"
# Which families' decode steps fit the native C step (the others log why and stay on torch).
NATIVE_STEP = {"qwen3": True, "phi3-mini": True, "phi4-mini": False, "gemma3-4b": True, "qwen3-moe": False,
               "qwen3-moe-sparse": False, "mixtral": False}


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    """case -> (folder, transformers' model, its greedy tokens for every prompt), each built once."""
    built = {}

    def get(case: str):
        if case not in built:
            path = make_family_model(tmp_path_factory.mktemp(case), case)
            model = hf_model(path, case)
            tokens = {rid: engine_probe.hf_greedy_tokens(model, p, NEW_TOKENS) for rid, p in PROMPTS.items()}
            built[case] = (path, model, tokens)
        return built[case]

    return get


def _kv_bytes(model, blocks: int, block_size: int = BLOCK) -> int:
    cfg = getattr(model.config, "text_config", model.config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return blocks * 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim * 4


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_matches_transformers_through_the_paged_engine(family, case, monkeypatch):
    """256-token steps (the long prompt prefills in chunks) and a cache of 288 blocks of 8 tokens, too small for all
    eight: greedy tokens and the logits of every computed position equal transformers'. The long prompt goes first:
    after the short ones a prompt longer than a step would wait until all of it fits, and nobody would be preempted;
    first, the short ones start beside it (each with a block to spare) and the decodes outgrow the cache (8-token
    blocks, so 16 new tokens grow a sequence by more than its spare one). Phi-3-mini's window (every layer sliding)
    frees the long prompt's early blocks as it advances, so there it goes last, where the rule does not apply."""
    path, model, expected = family(case)
    llm = LLM(str(path), dtype="float32", block_size=8, max_num_batched_tokens=256,
              kv_cache_memory=_kv_bytes(model, 288, block_size=8))
    engine = llm.engine
    run = engine_probe.ProbeRun()
    engine_probe.attach(engine, run, monkeypatch)
    windowed = engine.block_manager.window is not None
    engine_probe.generate(engine, PROMPTS if windowed else {LONG: PROMPTS[LONG]} | PROMPTS, NEW_TOKENS, run)
    assert engine.stats().num_preemptions > 0
    assert (engine.runner.native_step is not None) == NATIVE_STEP[case]
    assert (run.native_steps > 0) == NATIVE_STEP[case]
    for rid, prompt in PROMPTS.items():
        assert run.tokens[rid][len(prompt):] == expected[rid], rid
    engine_probe.assert_matches(run, model)


def test_longrope_long_factors_change_the_long_prompt(family):
    """Guards the comparisons: with the short factors only, transformers' logits for the long prompt differ, so a
    sequence reading the wrong table cannot pass."""
    path, model, _ = family("phi3-mini")
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg["rope_parameters"]
    short_only = hf_model(path, "phi3-mini")
    short_only.model.rotary_emb.long_inv_freq = short_only.model.rotary_emb.original_inv_freq.clone()
    ids = torch.tensor([PROMPTS[LONG]])
    with torch.inference_mode():
        diff = (model(ids).logits - short_only(ids).logits).abs().max().item()
    assert rope["long_factor"] != rope["short_factor"] and diff > 1e-2


@pytest.mark.parametrize("case", ["phi3-mini", "phi4-mini"])  # with and without the native step
def test_longrope_switching_mid_decode_matches_transformers_generate(family, case):
    """A prompt just short of the pretraining length decodes across it: the short factors until then; at the
    crossing the sequence recomputes its whole cache with the long ones (transformers' Phi-3 drops its cache there,
    prepare_inputs_for_generation), once. Blocks cached by a short sequence are not found by a long prompt sharing
    their tokens (their keys turned with the short factors); a short prompt sharing them still finds them."""
    path, model, _ = family(case)
    prompt = PROMPTS[LONG][: ORIGINAL - 4]
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert list(out.outputs[0].token_ids) == engine_probe.hf_greedy_tokens(model, prompt, NEW_TOKENS)
    assert llm.engine.stats().num_preemptions == 1  # the recompute at the switch
    fresh = LLM(str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=512)
    short, longer, short_again = (PROMPTS[LONG][:n] for n in (ORIGINAL - 100, ORIGINAL + 8, ORIGINAL - 50))
    outs = [fresh.generate([p], params)[0] for p in (short, longer, short_again)]
    assert [o.metrics.num_cached_tokens > 0 for o in outs] == [False, False, True]
    for prompt, out in zip((short, longer, short_again), outs):
        assert list(out.outputs[0].token_ids) == engine_probe.hf_greedy_tokens(model, prompt, NEW_TOKENS)


GGUF_CASES = {"qwen3": {}, "phi4-mini": {}, "phi3-mini": {"attn_qkv": T.Q8_0, "ffn_up": T.Q8_0},
              "qwen3-moe-sparse": {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q8_0, "ffn_down_exps": T.Q8_0}}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_family_gguf_matches_transformers(family, case, tmp_path):
    """A GGUF of the same weights in llama.cpp's layout (Phi-3's fused attn_qkv / ffn_up in Q8_0 kept in their
    blocks and split by rows at load; its LongRoPE factors as tensors): transformers' tokens on the values the file
    holds."""
    path, _, expected = family(case)
    gguf_path, stored = write_gguf(path, tmp_path / f"{case}.gguf", GGUF_CASES[case])
    quantized = bool(GGUF_CASES[case])
    if quantized:
        reference = hf_model(path, case, stored)
        expected = {rid: engine_probe.hf_greedy_tokens(reference, PROMPTS[rid], NEW_TOKENS) for rid in ("p2", LONG)}
    # The folder's tokenizer: exporting one from the GGUF vocabulary costs ~30 s per new file.
    llm = LLM(str(gguf_path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=512, tokenizer=str(path),
              gguf_weights="packed" if quantized else "auto")
    cfg = llm.engine.loaded.hf_config
    assert cfg["architectures"] == [CASES[case][0]]
    outs = llm.generate([PROMPTS["p2"], PROMPTS[LONG]], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                       ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == [expected["p2"], expected[LONG]]


QUANT_CASES = {"qwen3": "gptq", "phi3-mini": "awq", "phi4-mini": "gptq", "gemma3-4b": "gptq", "qwen3-moe": "gptq"}


@pytest.mark.parametrize("case", sorted(QUANT_CASES))
def test_family_group_quant_checkpoint_matches_transformers(family, case, tmp_path):
    """4-bit GPTQ / AWQ checkpoints (Phi-3's fused qkv_proj and gate_up_proj quantized as single layers, split by
    output columns at load): transformers' tokens on the dequantized weights."""
    path, _, _ = family(case)
    reference = hf_model(path, case, write_group_quant(path, tmp_path / "q", QUANT_CASES[case]))
    prompts = [PROMPTS["p3"], PROMPTS["p6"]]
    llm = LLM(str(tmp_path / "q"), dtype="float32", block_size=BLOCK, lm_head_quantization="none")
    assert llm.engine.loaded.quant.name == QUANT_CASES[case]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == engine_probe.hf_greedy_tokens(reference, prompt, NEW_TOKENS)


def test_gemma3_multimodal_transformers5_names_load_the_same_weights(family, tmp_path):
    """The text model under `model.language_model.` (transformers 5's names) loads as under `language_model.model.`
    (the Hub's); the vision tower is skipped either way."""
    path, _, _ = family("gemma3-4b")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (renamed / name).write_bytes((path / name).read_bytes())
    weights = load_file(str(path / "model.safetensors"))
    assert any(k.startswith("language_model.model.") for k in weights) and any("vision_tower" in k for k in weights)
    new = {k.replace("language_model.model.", "model.language_model.").replace("vision_tower.", "model.vision_tower.")
           .replace("multi_modal_projector.", "model.multi_modal_projector."): v for k, v in weights.items()}
    save_file(new, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    a = LLM(str(path), dtype="float32").engine.loaded.model.state_dict()
    b = LLM(str(renamed), dtype="float32").engine.loaded.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_through_triton_like_the_torch_path(family, case):
    """The Triton attention kernel (compiled on CUDA, under Triton's interpreter elsewhere) over each family's model
    code, reading the same RoPE tables: greedy tokens equal the torch path's and transformers' on a short prompt
    (the interpreter is too slow for the long one; its RoPE rows are the torch path's, checked above)."""
    pytest.importorskip("triton")
    from attention_cases import DEVICE

    path, _, expected = family(case)
    prompts = [PROMPTS["p3"]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(path), attention_backend=backend, dtype="float32", block_size=BLOCK, max_num_batched_tokens=16,
                  kv_cache_memory=1 << 22, device=DEVICE.type)
        tokens[backend] = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"] == [expected["p3"][:3]]
