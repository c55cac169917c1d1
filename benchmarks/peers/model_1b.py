"""A 1B-shaped model for the cost-as-the-work-grows rows: Llama-3.2-1B's real widths (hidden 2048, 16 layers,
32 query / 8 KV heads of 64, MLP 8192, tied head, rope theta 500000) with SmolLM2's tokenizer and vocabulary (49152),
so prompts and the tokenizer are real, and random weights (normal, std 0.02, seeded: what transformers' init draws),
since no 1B checkpoint may be downloaded. Only speed is measured on it: every system reads the same bytes and does
the same arithmetic per token as on a trained model of that shape.

Written once as an HF folder (bf16 safetensors) under <peers cache>/models; make_model_1b.sh then converts it with
llama.cpp's own converter and quantizer (bf16, Q4_0, Q4_1, Q4_K_M, Q8_0 GGUF files in <peers cache>/gguf).

    python benchmarks/peers/model_1b.py            # prints the folder
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

import paths  # noqa: E402

NAME = "llama-1b-shape-smollm2-vocab"
SEED = 1234
INIT_STD = 0.02
# llama-quantize's type names, and the GGUF files make_model_1b.sh writes (bf16 comes from the converter)
QUANTS = ("Q4_0", "Q4_1", "Q4_K_M", "Q8_0")


@dataclass(frozen=True, slots=True)
class Shape:
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 16
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 49152
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.hidden_size != self.num_attention_heads * self.head_dim:
            raise ValueError("hidden_size must equal num_attention_heads * head_dim")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


def folder() -> Path:
    return paths.peers_cache() / "models" / NAME


def gguf_file(kind: str) -> Path:
    """kind: 'bf16' or one of QUANTS (any case)."""
    return paths.gguf_dir() / f"{NAME}-{kind.lower()}.gguf"


def config(shape: Shape, tokenizer_dir: Path) -> dict:
    tok = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    ids = {t["content"]: int(i) for i, t in tok.get("added_tokens_decoder", {}).items()}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **asdict(shape),
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
            "bos_token_id": ids.get(tok.get("bos_token"), 1), "eos_token_id": ids.get(tok.get("eos_token"), 2),
            "initializer_range": INIT_STD, "torch_dtype": "bfloat16", "use_cache": True}


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    h, kv = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    out = {"model.embed_tokens.weight": (shape.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (shape.intermediate_size, h),
                p + "mlp.up_proj.weight": (shape.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, shape.intermediate_size)}
    return out


def weights(shape: Shape, seed: int = SEED) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, dims in tensor_shapes(shape).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(dims, dtype=torch.bfloat16)
        else:
            out[name] = (torch.randn(dims, generator=gen) * INIT_STD).to(torch.bfloat16)
    return out


def write(target: Path, shape: Shape = Shape()) -> Path:
    """The HF folder at `target` (kept when complete: the weights are a pure function of shape and seed)."""
    from safetensors.torch import save_file

    from pagedserve.engine.loading.model_store import resolve_model

    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    tokenizer_dir = resolve_model(None).tokenizer_dir
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in tokenizer_dir.iterdir():
        if f.name != "generation_config.json":
            shutil.copy(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(config(shape, tokenizer_dir), indent=2))
    save_file(weights(shape), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


if __name__ == "__main__":
    print(write(folder()))
