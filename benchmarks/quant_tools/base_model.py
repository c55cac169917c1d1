"""Write a small random fp16 Llama checkpoint (config.json, model.safetensors, a word-level tokenizer).

Plain torch + safetensors + tokenizers so that every tool venv (transformers 4.44 / 4.51 / 5.18) can
read it: config.json is written by hand in the classic Llama schema.

Weights are scaled so activations are O(1) and logits have std ~0.7 (max ~2.6): the usual 0.02 init
gives near-constant logits (a 1e-2 comparison would say nothing), while logits of std 3 (max 11) make
the tools' own fp16 arithmetic wander by 0.02 (transformers fp16 vs fp32 on the same weights), more
than the 1e-2 we compare at. At this scale that fp16 noise floor is ~0.006.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TinyLlama:
    hidden: int = 256
    intermediate: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 128
    max_positions: int = 512

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def config_json(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "torch_dtype": "float16",
            "use_cache": True,
        }

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """HF name suffix -> (out, in)."""
        h, i, kv = self.hidden, self.intermediate, self.kv_heads * self.head_dim
        return {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def random_state_dict(spec: TinyLlama, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.float16)

    sd = {"model.embed_tokens.weight": randn(spec.vocab, spec.hidden, std=1.0),
          "model.norm.weight": (1 + 0.1 * torch.randn(spec.hidden, generator=g)).to(torch.float16),
          "lm_head.weight": randn(spec.vocab, spec.hidden, std=0.7 / math.sqrt(spec.hidden))}
    for layer in range(spec.layers):
        p = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[f"{p}.{norm}.weight"] = (1 + 0.1 * torch.randn(spec.hidden, generator=g)).to(torch.float16)
        for name, (out_f, in_f) in spec.linear_shapes().items():
            mod = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            # Heavy-ish tails per input channel make act-order and AWQ scaling matter.
            col_scale = torch.exp(0.5 * torch.randn(in_f, generator=g))
            w = torch.randn(out_f, in_f, generator=g) * col_scale / math.sqrt(in_f)
            sd[f"{p}.{mod}.{name}.weight"] = w.to(torch.float16)
    return sd


def write_tokenizer(spec: TinyLlama, out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, spec.vocab)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": spec.max_positions}, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}, indent=1))


def write_base_model(out: Path, spec: TinyLlama = TinyLlama(), seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(spec.config_json(), indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    save_file(random_state_dict(spec, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(spec, out)
    return out


if __name__ == "__main__":
    import sys

    print(write_base_model(Path(sys.argv[1])))
