"""Every GGUF tensor type the loader accepts, on a tiny tensor written with gguf's own writer and quantizer: the
loader's values equal gguf.quants.dequantize's. Unknown types and architectures fail by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from gguf_fixtures import add_tensor, finish, quantized, reference_values, write_tiny_llama
from pagedserve.engine import LLM
from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.loading.gguf_file import SUPPORTED_TYPES, GgufFile


def _write_one(path, name: str, stored: np.ndarray, qtype: T, arch: str = "llama"):
    writer = GGUFWriter(str(path), arch)
    add_tensor(writer, name, stored, qtype)
    finish(writer)
    return path


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_dequantized_values_equal_gguf_quants(tmp_path, type_name):
    qtype = T[type_name]
    rng = np.random.default_rng(qtype.value)
    values = rng.normal(0, 1, (3, 512)).astype(np.float32)  # 512: whole blocks for every type (K: 256)
    stored = quantized(values, qtype, rng)
    expected = torch.from_numpy(reference_values(stored, qtype))
    assert expected.shape == (3, 512) and torch.isfinite(expected).all()
    [(name, ours)] = GgufFile(_write_one(tmp_path / "one.gguf", "blk.0.ffn_up.weight", stored, qtype)).tensors()
    assert name == "blk.0.ffn_up.weight" and ours.dtype == torch.float32
    assert torch.equal(ours, expected)


def test_an_unsupported_tensor_type_is_refused_listing_the_supported(tmp_path):
    path = write_tiny_llama(tmp_path / "tq.gguf", types={"ffn_down": T.TQ2_0, "blk.1.ffn_down": T.TQ2_0})
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_down\.weight has GGUF type TQ2_0, unsupported; "
                                             r"supported: F32, F16, BF16, Q8_0, .*Q6_K"):
        LLM(str(path), dtype="float32")


def test_an_unknown_architecture_is_refused_listing_the_supported(tmp_path):
    path = write_tiny_llama(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError,
                       match="unknown GGUF architecture 'gpt2'; supported: gemma3, llama, phi3, qwen2, qwen3"):
        LLM(str(path), dtype="float32")


def test_a_truncated_gguf_names_the_file(tmp_path):
    path = write_tiny_llama(tmp_path / "cut.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        LLM(str(path), dtype="float32")


def test_a_tensor_outside_the_architecture_is_named(tmp_path):
    """llama.cpp writes Llama 3.1's rope scaling as a rope_freqs tensor: dropping it would change every output."""
    path = write_tiny_llama(tmp_path / "rope.gguf", extra={"rope_freqs.weight": np.ones(8)})
    with pytest.raises(ModelLoadError, match="tensor rope_freqs.weight: not part of a LlamaForCausalLM GGUF"):
        LLM(str(path), dtype="float32")
