"""GGUF architectures: llama.cpp's metadata keys and tensor names -> an HF config and HF tensor names.

What each entry undoes was checked against transformers' own GGUF loader (modeling_gguf_pytorch_utils.py and
integrations/ggml.py), which tests/test_gguf_models.py uses as the oracle: llama.cpp permutes Llama's Q/K rows
for its rotary layout, and stores Gemma's norm weights as 1 + w.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from pagedserve.engine.errors import ModelLoadError
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


GGUF_ARCHS: Registry[GgufArch] = Registry("GGUF architecture")
GGUF_ARCHS.register("llama")(GgufArch(
    "LlamaForCausalLM", "llama", MappingProxyType(_PROJECTIONS | _LLAMA_NORMS),
    MappingProxyType(_CONFIG_KEYS | {"rope.dimension_count": "head_dim"}), permute_qk=True))
GGUF_ARCHS.register("qwen2")(GgufArch("Qwen2ForCausalLM", "qwen2", MappingProxyType(_PROJECTIONS | _LLAMA_NORMS)))
GGUF_ARCHS.register("gemma3")(GgufArch(
    "Gemma3ForCausalLM", "gemma3_text", MappingProxyType(_PROJECTIONS | _GEMMA3_NORMS),
    MappingProxyType(_CONFIG_KEYS | {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"}),
    norm_offset=1.0))


def gguf_arch(name: str) -> GgufArch:
    try:
        return GGUF_ARCHS.get(name)
    except UnknownImplementationError as exc:
        raise ModelLoadError(f"general.architecture: {exc}") from None


def hf_config(arch_name: str, metadata: Mapping[str, Any], tensor_names: tuple[str, ...]) -> dict[str, Any]:
    """The HF config dict transformers would build for this file (its config class fills the defaults), plus
    `architectures` and dtype float32: the dequantized values are exact in fp32."""
    from transformers import AutoConfig

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
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if not fields.get(k)]
    if missing:
        raise ModelLoadError(f"GGUF metadata: {missing[0]} missing ({arch_name}.* keys)")
    config = AutoConfig.for_model(arch.model_type, **fields).to_dict()
    return config | {"architectures": [arch.hf_architecture], "dtype": "float32"}


def _rope_scaling(arch_name: str, metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = metadata.get(f"{arch_name}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ModelLoadError(f"{arch_name}.rope.scaling.type: {kind!r} unsupported in GGUF files; supported: linear")
    factor = metadata.get(f"{arch_name}.rope.scaling.factor")
    if factor is None:
        raise ModelLoadError(f"{arch_name}.rope.scaling.factor: missing for rope.scaling.type linear")
    return {"rope_type": "linear", "factor": float(factor)}


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
