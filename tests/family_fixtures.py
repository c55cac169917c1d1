"""Tiny random checkpoints of the Qwen3 (dense and mixture-of-experts), Phi-3 / Phi-4-mini and Gemma 3 multimodal
layouts, built by transformers from each family's config class, and the same weights written as llama.cpp GGUF files
and GPTQ/AWQ checkpoints.

Shapes keep each family's real head layout at toy width: Qwen3's head_dim above hidden / heads, GQA and a tied
head; Phi-3-mini's MHA, untied head and 2047-token sliding window; Phi-4-mini's 3:1 GQA, tied head and 3/4
partial rotary; Gemma 3 4B's nested text_config, interleaved local/global layers and linear RoPE on global ones.
Every long-context RoPE switches regime at 2048 tokens, so one prompt past 2k exercises it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from safetensors.torch import load_file, save_file

from gguf_fixtures import add_tensor, finish, quantized
from pagedserve.engine.loading.model_store import resolve_model
from pagedserve.quant.packing import pack_awq, pack_cols, pack_rows

ORIGINAL = 2048  # pretraining length of every scaled RoPE here
_COMMON = dict(vocab_size=49152, intermediate_size=128, num_hidden_layers=2, eos_token_id=2, bos_token_id=1,
               pad_token_id=0, initializer_range=0.1, max_position_embeddings=4 * ORIGINAL)


def _longrope(rotary_dim: int) -> dict:
    half = rotary_dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 1.5 * i for i in range(half)]}


CASES = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        rope_theta=1e6,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL})),
    "phi3-mini": ("Phi3ForCausalLM", "Phi3Config", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False, sliding_window=2047,
        original_max_position_embeddings=ORIGINAL, rope_scaling=_longrope(16))),
    "phi4-mini": ("Phi3ForCausalLM", "Phi3Config", dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True, sliding_window=None,
        partial_rotary_factor=0.75, original_max_position_embeddings=ORIGINAL, rope_scaling=_longrope(12))),
    "gemma3-4b": ("Gemma3ForConditionalGeneration", "Gemma3Config", {}),
    # Qwen3-30B-A3B's layout at toy width: 128 experts, 8 per token, renormalised weights; here 8 experts, 2 per
    # token, a dense first layer (mlp_only_layers) beside a sparse one, and experts narrower than the dense MLP.
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        rope_theta=1e6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        mlp_only_layers=[0], decoder_sparse_step=1)),
    # Mixtral's layout: 4 experts, 2 per token, the checkpoint's block_sparse_moe / w1 w2 w3 names
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # every layer sparse, as llama.cpp's qwen3moe files are (the GGUF case)
    "qwen3-moe-sparse": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        rope_theta=1e6, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=True)),
}
_GEMMA_TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=512,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_hidden_layers=3,
                   query_pre_attn_scalar=16, rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})


def _config(case: str):
    import transformers

    arch, config_cls, fields = CASES[case]
    cls = getattr(transformers, config_cls)
    if case.startswith("gemma3"):
        text = {**_COMMON, **_GEMMA_TEXT}
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                      patch_size=14)
        return cls(text_config=text, vision_config=vision, mm_tokens_per_image=4, eos_token_id=2, bos_token_id=1,
                   pad_token_id=0)
    return cls(**{**_COMMON, **fields})


def make_family_model(path: Path, case: str, seed: int = 0) -> Path:
    """The HF folder (safetensors as transformers saves it, the default model's tokenizer files). Norm weights are
    randomized: their init (ones, or zeros for Gemma) would hide a norm applied wrongly or not at all."""
    import transformers

    arch = CASES[case][0]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(_config(case)).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    weights = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1)
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            scale = 0.5 if case.startswith("gemma3") else 0.3
            base = 0.0 if case.startswith("gemma3") else 1.0
            weights[name] = base + scale * torch.randn(tensor.shape, generator=gen)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    src = resolve_model(None).tokenizer_dir
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((src / name).read_bytes())
    return path


def hf_model(path: Path, case: str, state: dict[str, torch.Tensor] | None = None):
    """transformers' fp32 model of the folder (its weights replaced by `state` where given)."""
    import transformers

    model = getattr(transformers, CASES[case][0]).from_pretrained(str(path), dtype=torch.float32).eval()
    if state is not None:
        # The file's names are the Hub's (language_model.model.*); transformers 5's modules say model.language_model.*
        own = model.state_dict()
        renamed = {k if k in own else k.replace("language_model.model.", "model.language_model.")
                   .replace("vision_tower.", "model.vision_tower.")
                   .replace("multi_modal_projector.", "model.multi_modal_projector."): v for k, v in state.items()}
        renamed = _fused_experts(renamed, own)
        assert set(renamed) <= set(own), sorted(set(renamed) - set(own))[:3]
        model.load_state_dict(renamed, strict=False)
    return model


def _fused_experts(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Hub's per-expert tensors (mlp.experts.N.gate_proj.weight, ...) as transformers 5's modules hold them:
    mlp.experts.gate_up_proj [experts, 2 x moe_intermediate, hidden] (gate rows first) and down_proj [experts, ...]."""
    out, experts = {}, {}
    for name, tensor in state.items():
        head, sep, rest = name.partition(".mlp.experts.")
        if sep and f"{head}.mlp.experts.gate_up_proj" in own:
            index, part = rest.split(".", 1)
            experts.setdefault(head, {})[(int(index), part)] = tensor
        else:
            out[name] = tensor
    for head, parts in experts.items():
        count = 1 + max(index for index, _ in parts)
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([parts[(e, "gate_proj.weight")], parts[(e, "up_proj.weight")]]) for e in range(count)])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([parts[(e, "down_proj.weight")] for e in range(count)])
    return out


# -- GGUF, laid out as llama.cpp's convert_hf_to_gguf.py writes these architectures ------------------------------

_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
# per-expert HF projections -> the stacked tensor llama.cpp writes for each ([experts, rows, cols])
_GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, index, rest = stem.split(".", 3)
        if rest.startswith("mlp.experts."):
            return f"blk.{index}.{_GGUF_EXPERTS[rest.split('.')[-1]]}.{suffix}"
        return f"blk.{index}.{_GGUF_LAYER[rest]}.{suffix}"
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[stem] + f".{suffix}"


def write_gguf(hf_dir: Path, out: Path, types: dict[str, T] | None = None) -> tuple[Path, dict[str, torch.Tensor]]:
    """The folder's weights and config as a GGUF of its architecture (F32 unless `types` names a GGUF tensor kind, e.g.
    {"attn_qkv": Q8_0}); returns the file and the HF state as the file stores it (quantized values dequantized),
    the reference transformers must run on."""
    from gguf.quants import dequantize

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = {"Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3",
            "Qwen3MoeForCausalLM": "qwen3moe"}[cfg["architectures"][0]]
    writer = GGUFWriter(str(out), arch)
    _gguf_metadata(writer, arch, cfg)  # no vocabulary: the tests pass the folder's tokenizer (parsing 49k
    # strings with gguf's reader costs ~15 s per file here; the tokenizer path is test_gguf_models.py's)
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    rng = np.random.default_rng(0)
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in _stacked_experts(load_file(str(hf_dir / "model.safetensors"))).items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        gguf_name = _gguf_name(name)
        qtype = (types or {}).get(gguf_name.split(".")[-2], T.F32)
        values = quantized(tensor.numpy(), qtype, rng) if tensor.dim() >= 2 else tensor.numpy().astype(np.float32)
        add_tensor(writer, gguf_name, values, qtype if tensor.dim() >= 2 else T.F32)
        stored[name] = torch.from_numpy(dequantize(values, qtype).astype(np.float32).reshape(tensor.shape)) \
            if tensor.dim() >= 2 and qtype != T.F32 else tensor
    finish(writer)
    return out, _split_experts(stored)


def _stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert projections stacked as llama.cpp writes them: ...mlp.experts.<proj> [experts, rows, cols]."""
    out, experts = {}, {}
    for name, tensor in state.items():
        head, sep, rest = name.partition(".mlp.experts.")
        if sep:
            index, proj = rest.split(".")[:2]
            experts.setdefault(f"{head}.mlp.experts.{proj}", {})[int(index)] = tensor
        else:
            out[name] = tensor
    for name, parts in experts.items():
        out[f"{name}.weight"] = torch.stack([parts[e] for e in range(len(parts))])
    return out


def _split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        head, sep, rest = name.partition(".mlp.experts.")
        if sep:
            out |= {f"{head}.mlp.experts.{e}.{rest}": tensor[e] for e in range(tensor.shape[0])}
        else:
            out[name] = tensor
    return out


def _gguf_metadata(writer: GGUFWriter, arch: str, cfg: dict) -> None:
    rope = cfg.get("rope_parameters") or {}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    if arch in ("qwen3", "qwen3moe"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch != "phi3":
        return
    original = rope["original_max_position_embeddings"]
    scale = cfg["max_position_embeddings"] / original
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
    writer.add_sliding_window(cfg.get("sliding_window") or 0)
    writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))


# -- GPTQ / AWQ: each linear rounded to 4 bits in groups of 32 (round to nearest, asymmetric) --------------------

def _round_to_grid(weight: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] -> (q [in, out], zeros [groups, out], fp16 scales [groups, out])."""
    w = weight.t().reshape(weight.shape[1] // group, group, weight.shape[0])  # [groups, group, out]
    lo, hi = w.amin(1), w.amax(1)
    scales = ((hi - lo).clamp(min=1e-6) / 15).half()
    s = scales.float()
    zeros = torch.round(-lo / s).clamp(0, 15).to(torch.int32)
    q = torch.clamp(torch.round(w / s[:, None]) + zeros[:, None], 0, 15).to(torch.int32)
    return q.reshape(weight.shape[1], weight.shape[0]), zeros, scales


def write_group_quant(hf_dir: Path, out: Path, method: str) -> dict[str, torch.Tensor]:
    """The folder's linears (not the LM head) as a GPTQ (v1 zeros) or AWQ (GEMM) checkpoint in `out`; returns the
    HF state with those linears dequantized, the reference transformers must run on."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    written, reference = {}, dict(tensors)
    for name, tensor in tensors.items():
        if not (name.endswith("_proj.weight") and ".layers." in name and "vision" not in name):
            written[name] = tensor
            continue
        q, zeros, scales = _round_to_grid(tensor)
        prefix = name.removesuffix(".weight")
        if method == "gptq":
            written |= {f"{prefix}.qweight": pack_rows(q, 4), f"{prefix}.qzeros": pack_cols((zeros - 1) & 15, 4),
                        f"{prefix}.scales": scales,
                        f"{prefix}.g_idx": torch.arange(q.shape[0], dtype=torch.int32) // 32}
        else:
            written |= {f"{prefix}.qweight": pack_awq(q), f"{prefix}.qzeros": pack_awq(zeros),
                        f"{prefix}.scales": scales}
        groups = torch.arange(q.shape[0]) // 32
        reference[name] = ((q - zeros[groups]).float() * scales.float()[groups]).t().contiguous()
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                   "sym": False, "checkpoint_format": "gptq"} if method == "gptq" else
                                  {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                   "version": "gemm"})
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((hf_dir / name).read_bytes())
    return reference
