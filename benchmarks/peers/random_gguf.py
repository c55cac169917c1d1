"""A random Llama-shaped GGUF in the default file's layout (Q4_1 linears, a Q8_0 tied embedding, F32 norms, the
default model's vocabulary and tokenizer), for speed rows that need a model size no checkpoint here has (never in
CI). Only speed is measured on it: every system reads the same bytes and does the same arithmetic per token as on a
trained model of that shape. The blocks are made by gguf's own quantizer (PyPI `gguf`, llama.cpp's gguf-py), so no
llama.cpp build is needed; llama-quantize writes the same block format.

    python benchmarks/peers/random_gguf.py smollm2-360m     # prints the file (under <peers cache>/gguf)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import quantize

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

import paths  # noqa: E402

SEED = 1234
INIT_STD = 0.02


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int = 64
    rope_theta: float = 100000.0


# real models' widths with SmolLM2's vocabulary (49152)
SHAPES = {
    "smollm2-360m": Shape(960, 2560, 32, 15, 5),
    "qwen2.5-0.5b-widths": Shape(896, 4864, 24, 14, 2),
    "llama-1b-widths": Shape(2048, 8192, 16, 32, 8, rope_theta=500000.0),
}


def _linear_shapes(s: Shape, i: int) -> list[tuple[str, tuple[int, int]]]:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return [(f"blk.{i}.attn_q.weight", (q, s.hidden)), (f"blk.{i}.attn_k.weight", (kv, s.hidden)),
            (f"blk.{i}.attn_v.weight", (kv, s.hidden)), (f"blk.{i}.attn_output.weight", (s.hidden, q)),
            (f"blk.{i}.ffn_gate.weight", (s.intermediate, s.hidden)),
            (f"blk.{i}.ffn_up.weight", (s.intermediate, s.hidden)),
            (f"blk.{i}.ffn_down.weight", (s.hidden, s.intermediate))]


def _add(writer: GGUFWriter, name: str, values: np.ndarray, qtype: T) -> None:
    if qtype == T.F32:
        writer.add_tensor(name, values.astype(np.float32))
    else:
        writer.add_tensor(name, quantize(values.astype(np.float32), qtype), raw_dtype=qtype)


def _copy_tokenizer(writer: GGUFWriter, source: Path) -> int:
    from gguf import GGUFReader

    fields = GGUFReader(source).fields
    value = lambda key: fields[key].contents()  # noqa: E731
    writer.add_tokenizer_model(value("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(value("tokenizer.ggml.pre"))
    writer.add_token_list(value("tokenizer.ggml.tokens"))
    writer.add_token_types(value("tokenizer.ggml.token_type"))
    writer.add_token_merges(value("tokenizer.ggml.merges"))
    writer.add_bos_token_id(value("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(value("tokenizer.ggml.eos_token_id"))
    writer.add_chat_template(value("tokenizer.chat_template"))
    return len(value("tokenizer.ggml.tokens"))


def write(name: str, shape: Shape, source: Path, out: Path) -> None:
    rng = np.random.default_rng(SEED)
    writer = GGUFWriter(str(out), "llama")
    writer.add_name(name)
    writer.add_block_count(shape.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape.head_dim)
    vocab = _copy_tokenizer(writer, source)
    writer.add_vocab_size(vocab)
    normal = lambda dims: rng.normal(0.0, INIT_STD, dims).astype(np.float32)  # noqa: E731
    _add(writer, "token_embd.weight", normal((vocab, shape.hidden)), T.Q8_0)
    _add(writer, "output_norm.weight", np.ones(shape.hidden, np.float32), T.F32)
    for i in range(shape.layers):
        _add(writer, f"blk.{i}.attn_norm.weight", np.ones(shape.hidden, np.float32), T.F32)
        _add(writer, f"blk.{i}.ffn_norm.weight", np.ones(shape.hidden, np.float32), T.F32)
        for tensor, dims in _linear_shapes(shape, i):
            _add(writer, tensor, normal(dims), T.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    args = parser.parse_args()
    from pagedserve.engine.loading.model_store import resolve_model

    out_dir = paths.peers_cache() / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"random-{args.shape}-smollm2-vocab-q4_1.gguf"
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        write(args.shape, SHAPES[args.shape], Path(resolve_model(None).weights), tmp)
        tmp.rename(out)
    print(out)


if __name__ == "__main__":
    main()
