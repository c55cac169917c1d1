"""Tiny GGUF files written with the gguf package's own writer, laid out as llama.cpp's converter writes them."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from pagedserve.engine.loading.gguf_header import read_header
from pagedserve.engine.loading.model_store import resolve_model

# gguf can dequantize the K types but not quantize them: their test blocks are random bytes with small, finite fp16
# scales at these byte offsets of each block (the layouts of gguf/quants.py's dequantize_blocks).
_K_SCALE_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
FLOAT_TYPES = (T.F32, T.F16)

# A small Llama (49152 tokens: the default model's vocabulary, so its tokenizer comes along); 256-wide FFN rows
# take the K types' 256-value blocks.
TINY_LLAMA = dict(hidden=64, intermediate=256, layers=2, heads=4, kv_heads=2, vocab=49152)
# One tensor type per projection, so the one file exercises them all through transformers' loader too.
TINY_LLAMA_TYPES = {
    "token_embd": T.Q8_0, "output": T.F16, "attn_q": T.Q4_0, "attn_k": T.Q5_0, "attn_v": T.Q4_1,
    "attn_output": T.Q5_1, "ffn_gate": T.BF16, "ffn_up": T.Q8_0, "ffn_down": T.Q4_K, "blk.1.ffn_down": T.Q6_K,
}


def quantized(values: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """What a file stores for `values` [rows, cols] in `qtype`: float arrays for F32/F16, block bytes otherwise."""
    if qtype == T.F32:
        return values.astype(np.float32)
    if qtype == T.F16:
        return values.astype(np.float16)
    if qtype in _K_SCALE_OFFSETS:
        return random_k_blocks(values.shape, qtype, rng)
    return quantize(values.astype(np.float32), qtype)


def random_k_blocks(shape: tuple[int, int], qtype: T, rng: np.random.Generator, scale: float = 2e-4) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:
        half = rng.uniform(scale / 2, scale, (rows, cols // block)).astype(np.float16)
        blocks[..., offset:offset + 2] = half[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def reference_values(stored: np.ndarray, qtype: T) -> np.ndarray:
    """gguf's own dequantization of what the file stores: the oracle for the loader's values."""
    return dequantize(stored, qtype).astype(np.float32)


def add_tensor(writer: GGUFWriter, name: str, stored: np.ndarray, qtype: T) -> None:
    if qtype in FLOAT_TYPES:
        writer.add_tensor(name, stored)
    else:
        writer.add_tensor(name, stored, raw_dtype=qtype)


def finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: the row order llama.cpp's rotary kernel reads Q/K in."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


@functools.cache
def _default_tokenizer_fields() -> dict[str, object]:
    """The default GGUF's tokenizer metadata, read once per process (most GGUF tests write a tiny model with it),
    with the engine's header reader asked for every value (0.1 s; gguf's stock reader takes 3 s over the 49k-token
    vocabulary)."""
    metadata = read_header(memoryview(np.memmap(resolve_model(None).weights, mode="r"))).metadata
    names = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id")
    values = {name: metadata[f"tokenizer.ggml.{name}"] for name in names}
    values["chat_template"] = metadata["tokenizer.chat_template"]
    return values


def copy_default_tokenizer(writer: GGUFWriter) -> None:
    """The default model's GGUF vocabulary (BPE, SmolLM2's pre-tokenizer, special ids and chat template)."""
    fields = _default_tokenizer_fields()
    writer.add_tokenizer_model(fields["model"])
    writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["token_type"])
    writer.add_token_merges(fields["merges"])
    writer.add_bos_token_id(fields["bos_token_id"])
    writer.add_eos_token_id(fields["eos_token_id"])
    writer.add_chat_template(fields["chat_template"])


def write_tiny_llama(path: Path, seed: int = 0, types: dict[str, T] | None = None, arch: str = "llama",
                     extra: dict[str, np.ndarray] | None = None) -> Path:
    """A random Llama as llama.cpp would write it: Q/K rows permuted, one tensor type per projection; `extra`:
    more F32 tensors by name."""
    types = TINY_LLAMA_TYPES | (types or {})
    d = TINY_LLAMA
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    writer.add_block_count(d["layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(d["hidden"])
    writer.add_feed_forward_length(d["intermediate"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(d["hidden"] // d["heads"])
    writer.add_vocab_size(d["vocab"])
    copy_default_tokenizer(writer)
    head_dim = d["hidden"] // d["heads"]
    for name, shape in _tiny_shapes(d, head_dim):
        kind = name.split(".")[-2]
        values = rng.normal(0, 0.05, shape).astype(np.float32) if len(shape) > 1 else \
            rng.uniform(0.8, 1.2, shape).astype(np.float32)
        if kind in ("attn_q", "attn_k"):
            values = llama_permute(values, d["heads"] if kind == "attn_q" else d["kv_heads"])
        qtype = types.get(name.removesuffix(".weight"), types.get(kind, T.F32))
        add_tensor(writer, name, quantized(values, qtype, rng), qtype)
    for name, values in (extra or {}).items():
        add_tensor(writer, name, values.astype(np.float32), T.F32)
    finish(writer)
    return path


def _tiny_shapes(d: dict, head_dim: int) -> list[tuple[str, tuple[int, ...]]]:
    h, f = d["hidden"], d["intermediate"]
    shapes = [("token_embd.weight", (d["vocab"], h)), ("output_norm.weight", (h,)), ("output.weight", (d["vocab"], h))]
    for i in range(d["layers"]):
        shapes += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (d["heads"] * head_dim, h)),
                   (f"blk.{i}.attn_k.weight", (d["kv_heads"] * head_dim, h)),
                   (f"blk.{i}.attn_v.weight", (d["kv_heads"] * head_dim, h)),
                   (f"blk.{i}.attn_output.weight", (h, d["heads"] * head_dim)), (f"blk.{i}.ffn_norm.weight", (h,)),
                   (f"blk.{i}.ffn_gate.weight", (f, h)), (f"blk.{i}.ffn_up.weight", (f, h)),
                   (f"blk.{i}.ffn_down.weight", (h, f))]
    return shapes
