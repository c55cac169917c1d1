"""GGUF architectures: llama.cpp's metadata keys and tensor names -> an HF config and HF tensor names.

What each entry undoes was checked against transformers' own GGUF loader (modeling_gguf_pytorch_utils.py and
integrations/ggml.py), which tests/test_gguf_models.py uses as the oracle: llama.cpp permutes Llama's Q/K rows
for its rotary layout, and stores Gemma's norm weights as 1 + w. Qwen3 and Phi-3 files (llama.cpp's convert_hf_to_gguf
layout: Phi-3's fused attn_qkv and ffn_up = [gate | up], its LongRoPE factors as the rope_factors_short/long tensors,
partial rotary as rope.dimension_count) and Qwen3 MoE files (each layer's experts stacked per projection) are
checked against transformers on the HF weights they were written from (tests/test_model_families.py):
transformers' GGUF loader reads neither those factors nor the partial rotary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.loading.config_defaults import filled_config
from pagedserve.kernels.registry import Registry, UnknownImplementationError

_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
              "padding_token_id": "pad_token_id"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PROJECTIONS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QWEN3_NORMS = _LLAMA_NORMS | {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Qwen3 MoE: the attention and norms of Qwen3; the router and each layer's experts as one 3-D tensor per projection
# ([experts, rows, cols]), handed to the model as one matrix per expert (GgufArch.expert_parts).
_QWEN3MOE_TENSORS = {k: v for k, v in _PROJECTIONS.items() if k.startswith("attn")} | _QWEN3_NORMS | {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj"}
_PHI3_TENSORS = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
                 "ffn_down": "mlp.down_proj"} | _LLAMA_NORMS
_GEMMA3_NORMS = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


@dataclass(frozen=True, slots=True)
class GgufArch:
    hf_architecture: str  # the model registry's name (config.json "architectures")
    model_type: str  # transformers' config class, which supplies every default the file leaves out
    layer_tensors: Mapping[str, str]  # blk.N.<gguf name> -> model.layers.N.<HF name>
    config_keys: Mapping[str, str] = field(default_factory=lambda: MappingProxyType(_CONFIG_KEYS))
    permute_qk: bool = False  # llama.cpp's converter interleaves Llama's Q/K rows for its rotary layout
    norm_offset: float = 0.0  # llama.cpp stores Gemma's norms as 1 + w (HF's Gemma computes x * (1 + w))
    # fused HF module (as layer_tensors names it) -> the model's linears it splits into (the loader splits the rows)
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    config_tensors: tuple[str, ...] = ()  # global tensors read into the config, not loaded as weights
    # (metadata, tensor reader) -> config fields the generic keys cannot express
    config_hook: Callable[[Mapping[str, Any], Callable[[str], torch.Tensor]], dict[str, Any]] | None = None

    def expert_parts(self, hf_name: str, num_experts: int) -> tuple[str, ...]:
        """HF names of each expert's matrix in a stacked expert tensor (`...mlp.experts.gate_proj.weight` ->
        `...mlp.experts.N.gate_proj.weight`); empty for any other tensor."""
        head, sep, rest = hf_name.partition(".mlp.experts.")
        if not sep or rest.split(".", 1)[0].isdigit():
            return ()
        return tuple(f"{head}.mlp.experts.{e}.{rest}" for e in range(num_experts))

    def fused_parts(self, hf_name: str) -> tuple[str, ...]:
        """HF names of the parts of a fused tensor (empty for any other)."""
        module, _, suffix = hf_name.rpartition(".")
        for fused, parts in self.fused.items():
            if module.endswith(f".{fused}"):
                owner = module[: -len(fused.rsplit(".", 1)[-1])]  # ends in "self_attn." / "mlp."
                return tuple(f"{owner}{part}.{suffix}" for part in parts)
        return ()


GGUF_ARCHS: Registry[GgufArch] = Registry("GGUF architecture")
GGUF_ARCHS.register("llama")(GgufArch(
    "LlamaForCausalLM", "llama", MappingProxyType(_PROJECTIONS | _LLAMA_NORMS),
    MappingProxyType(_CONFIG_KEYS | {"rope.dimension_count": "head_dim"}), permute_qk=True))
GGUF_ARCHS.register("qwen2")(GgufArch("Qwen2ForCausalLM", "qwen2", MappingProxyType(_PROJECTIONS | _LLAMA_NORMS)))


def _phi3_config(metadata: Mapping[str, Any], read: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    """Phi-3's partial rotary (rope.dimension_count of head_dim), sliding window (0: none, Phi-4) and LongRoPE
    factors (tensors; their attention factor only when it differs from the one transformers derives)."""
    heads, hidden = metadata["phi3.attention.head_count"], metadata["phi3.embedding_length"]
    out: dict[str, Any] = {"sliding_window": metadata.get("phi3.attention.sliding_window") or None}
    dims = metadata.get("phi3.rope.dimension_count")
    if dims is not None:
        out["partial_rotary_factor"] = dims / (hidden // heads)
    if "phi3.rope.scaling.original_context_length" in metadata:
        out["original_max_position_embeddings"] = metadata["phi3.rope.scaling.original_context_length"]
    try:
        short, long = read("rope_factors_short.weight"), read("rope_factors_long.weight")
    except KeyError:
        return out
    scaling = {"rope_type": "longrope", "short_factor": short.tolist(), "long_factor": long.tolist()}
    context = metadata["phi3.context_length"]
    factor = context / out.get("original_max_position_embeddings", context)
    derived = math.sqrt(1 + math.log(factor) / math.log(out["original_max_position_embeddings"])) if factor > 1 else 1.0
    stored = metadata.get("phi3.rope.scaling.attn_factor")
    if stored is not None and abs(stored - derived) > 1e-6 * derived:
        scaling["attention_factor"] = float(stored)
    return out | {"rope_scaling": scaling}


GGUF_ARCHS.register("qwen3")(GgufArch(
    "Qwen3ForCausalLM", "qwen3", MappingProxyType(_PROJECTIONS | _QWEN3_NORMS),
    MappingProxyType(_CONFIG_KEYS | {"attention.key_length": "head_dim"})))
GGUF_ARCHS.register("qwen3moe")(GgufArch(
    "Qwen3MoeForCausalLM", "qwen3_moe", MappingProxyType(_QWEN3MOE_TENSORS),
    MappingProxyType(_CONFIG_KEYS | {"attention.key_length": "head_dim", "expert_count": "num_experts",
                                     "expert_used_count": "num_experts_per_tok",
                                     "expert_feed_forward_length": "moe_intermediate_size"}),
    # llama.cpp renormalises the chosen experts' weights for this architecture (norm_w in its MoE graph)
    config_hook=lambda metadata, read: {"norm_topk_prob": True}))
GGUF_ARCHS.register("phi3")(GgufArch(
    "Phi3ForCausalLM", "phi3", MappingProxyType(_PHI3_TENSORS),
    fused=MappingProxyType({"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
                            "mlp.gate_up_proj": ("gate_proj", "up_proj")}),
    config_tensors=("rope_factors_long.weight", "rope_factors_short.weight"), config_hook=_phi3_config))
GGUF_ARCHS.register("gemma3")(GgufArch(
    "Gemma3ForCausalLM", "gemma3_text", MappingProxyType(_PROJECTIONS | _GEMMA3_NORMS),
    MappingProxyType(_CONFIG_KEYS | {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"}),
    norm_offset=1.0))


def gguf_arch(name: str) -> GgufArch:
    try:
        return GGUF_ARCHS.get(name)
    except UnknownImplementationError as exc:
        raise ModelLoadError(f"general.architecture: {exc}") from None


def hf_config(arch_name: str, metadata: Mapping[str, Any], tensor_names: tuple[str, ...],
              read_tensor: Callable[[str], torch.Tensor] | None = None) -> dict[str, Any]:
    """The HF config dict transformers would build for this file (its config class fills the defaults, through the
    cache of config_defaults.py), plus `architectures` and dtype float32: the dequantized values are exact in fp32."""
    arch = gguf_arch(arch_name)
    fields = {hf: metadata[f"{arch_name}.{key}"] for key, hf in arch.config_keys.items()
              if f"{arch_name}.{key}" in metadata}
    fields.setdefault("vocab_size", metadata.get("tokenizer.ggml.tokens"))
    fields |= {hf: metadata[f"tokenizer.ggml.{key}"] for key, hf in _TOKEN_IDS.items()
               if f"tokenizer.ggml.{key}" in metadata}
    fields["tie_word_embeddings"] = "output.weight" not in tensor_names  # llama.cpp omits a tied head
    scaling = _rope_scaling(arch_name, metadata)
    if scaling is not None:
        fields["rope_scaling"] = scaling
    if arch.config_hook is not None:
        fields |= arch.config_hook(metadata, read_tensor or _no_tensors)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if not fields.get(k)]
    if missing:
        raise ModelLoadError(f"GGUF metadata: {missing[0]} missing ({arch_name}.* keys)")
    config = filled_config(arch.model_type, fields)
    return config | {"architectures": [arch.hf_architecture], "dtype": "float32"}


def _no_tensors(name: str) -> torch.Tensor:
    raise KeyError(name)


def _rope_scaling(arch_name: str, metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """rope.scaling.* as HF rope_scaling: linear, and YaRN (Qwen3's long-context setting) with its pretraining
    length and betas; YaRN's attn_factor means a multiplier of llama.cpp's own in some converters and a
    replacement in others, so a file that sets it is refused rather than guessed at."""
    key = f"{arch_name}.rope.scaling"
    kind = metadata.get(f"{key}.type", "none")
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"{key}.type: {kind!r} unsupported in GGUF files; supported: linear, yarn")
    factor = metadata.get(f"{key}.factor")
    if factor is None:
        raise ModelLoadError(f"{key}.factor: missing for rope.scaling.type {kind}")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    original = metadata.get(f"{key}.original_context_length")
    if original is None:
        raise ModelLoadError(f"{key}.original_context_length: missing for rope.scaling.type yarn")
    if metadata.get(f"{key}.attn_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{key}.attn_factor: unsupported for yarn (its meaning differs between converters)")
    scaling = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if f"{key}.{gguf_key}" in metadata:
            scaling[hf_key] = float(metadata[f"{key}.{gguf_key}"])
    return scaling


def hf_tensor_name(arch: GgufArch, name: str) -> str:
    """The HF name of GGUF tensor `name`; a tensor the architecture does not know is refused by name."""
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in arch.layer_tensors:
        return f"model.layers.{parts[1]}.{arch.layer_tensors[parts[2]]}.{suffix}"
    known = sorted([*_GLOBAL_TENSORS, *(f"blk.N.{k}" for k in arch.layer_tensors)])
    raise ModelLoadError(f"tensor {name}: not part of a {arch.hf_architecture} GGUF; known: {', '.join(known)}")


def hf_tensor(arch: GgufArch, name: str, values: torch.Tensor, config: Mapping[str, Any]) -> tuple[str, torch.Tensor]:
    """(HF name, HF values) of one GGUF tensor; a tensor the architecture does not know is refused by name (a
    silently skipped `rope_freqs` would change every output). `values` may be a matrix's packed block rows
    [rows, row_bytes]: the Q/K row permutation moves whole rows, so it is exact on blocks too."""
    hf_name = hf_tensor_name(arch, name)
    stem = name.rpartition(".")[0]
    parts = stem.split(".")
    if arch.permute_qk and parts[-1] in ("attn_q", "attn_k"):
        heads = config["num_attention_heads"] if parts[-1] == "attn_q" else config["num_key_value_heads"]
        values = _unpermute_rows(values, heads)
    if arch.norm_offset and stem.endswith("norm"):
        values = values - arch.norm_offset  # in fp32, before any cast, as transformers does
    return hf_name, values


def _unpermute_rows(values: torch.Tensor, heads: int) -> torch.Tensor:
    """Undoes convert_hf_to_gguf.py's LlamaModel.permute: per head, rows (i, half) go back to (half, i)."""
    rows = values.shape[0]
    return values.reshape(heads, rows // heads // 2, 2, *values.shape[1:]).transpose(1, 2).reshape(values.shape)
