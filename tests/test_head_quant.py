"""`lm_head_quantization="q8_0"` and its `auto` default (quant/head_quant.py): an unquantized LM head multiplied from Q8_0 blocks made at
load, against gguf's own quantize/dequantize of the same weights; tied (the default model with its blocks expanded)
and untied (an AWQ tool fixture, whose head is 16-bit); a tied model looks tokens up in the same blocks and holds no
16-bit table; bad uses refused with the field named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from pagedserve.engine import LLM
from pagedserve.engine.build import check_backends
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError, ModelLoadError
from pagedserve.engine.loading.model_loader import load_model
from pagedserve.engine.loading.model_store import resolve_model
from pagedserve.quant.gguf import GgufLinearMethod, PackedEmbedding
from pagedserve.quant.head_quant import resolve_head_quantization
from quant_fixtures import fixture_dir

CPU = torch.device("cpu")


def _q8_0_reference(weight: torch.Tensor) -> torch.Tensor:
    """The head's weights as gguf rounds them to Q8_0 and back, fp64."""
    w = weight.detach().float().numpy()
    q = quantize(w, GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.asarray(dequantize(q, GGMLQuantizationType.Q8_0), dtype=np.float64)).reshape(w.shape)


def _check_head(head: torch.nn.Module, reference: torch.Tensor, rows: int) -> None:
    x = torch.randn(rows, reference.shape[1], generator=torch.Generator().manual_seed(rows))
    got = head(x.to(head.compute_dtype)).double()
    xd = x.to(head.compute_dtype).double()
    want = xd @ reference.T
    # int16 activation blocks (packed rows) or bf16 operands (the expanded companion): a few 2^-8 of |x||w|
    bound = 2.0**-7 * (xd.abs() @ reference.abs().T) + 1e-6
    assert ((got - want).abs() <= bound).all(), f"{rows} rows: max err {(got - want).abs().max().item()}"


@pytest.fixture(scope="module")
def tied_pair():
    """The default model with every GGUF block expanded (a dense tied head), with and without the option."""
    source = resolve_model(None)
    plain = load_model(source.weights, None, None, CPU, "dequantized")
    quantized = load_model(source.weights, None, None, CPU, "dequantized", "q8_0")
    return plain, quantized


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_tied_head_is_gguf_q8_0_of_the_embedding(tied_pair, rows: int) -> None:
    plain, quantized = (loaded.model for loaded in tied_pair)
    table = plain.model.embed_tokens.weight
    assert isinstance(quantized.lm_head.method, GgufLinearMethod) and quantized.lm_head.method.qtype == "Q8_0"
    _check_head(quantized.lm_head, _q8_0_reference(table), rows)


def test_a_tied_model_looks_tokens_up_in_the_heads_blocks(tied_pair) -> None:
    plain, quantized = (loaded.model for loaded in tied_pair)
    table = plain.model.embed_tokens.weight
    embedding = quantized.model.embed_tokens
    assert isinstance(embedding, PackedEmbedding) and embedding.weight is quantized.lm_head.weight  # one table
    ids = torch.tensor([0, 1, 17, 4096, table.shape[0] - 1, 17])
    want = _q8_0_reference(table)[ids].to(plain.model.embed_tokens(ids).dtype)
    assert torch.equal(embedding(ids), want)  # rows as gguf rounds them, in the compute dtype
    vocab_sized = [p for p in quantized.parameters() if p.shape[0] == table.shape[0]]
    assert vocab_sized and all(p.dtype == torch.uint8 for p in vocab_sized)  # no 16-bit table held beside them


def test_untied_16_bit_head_of_an_awq_checkpoint() -> None:
    path = fixture_dir("awq_4bit_g64")
    stored = load_file(str(path / "model.safetensors"))["lm_head.weight"]
    quantized = load_model(path, torch.bfloat16, None, CPU, lm_head_quantization="q8_0").model
    reference = _q8_0_reference(stored.to(torch.bfloat16))
    for rows in (1, 12):
        _check_head(quantized.lm_head, reference, rows)


def test_the_native_step_reads_the_packed_head() -> None:
    """`auto`, the default, makes an AWQ checkpoint's 16-bit head Q8_0 on CPU, and says so in the description."""
    llm = LLM(str(fixture_dir("awq_4bit_g64")), dtype="bfloat16")
    step = llm.engine.runner.native_step
    assert step is not None and isinstance(llm.engine.loaded.model.lm_head.method, GgufLinearMethod)
    assert llm.engine.loaded.lm_head_quantization == "q8_0"
    assert llm.engine.describe().quantization.endswith(", lm_head q8_0")


def test_auto_keeps_every_other_head_as_stored(tied_pair) -> None:
    plain, _ = tied_pair  # a 16-bit model: its head is not rounded unless asked
    assert plain.lm_head_quantization == "none"
    assert resolve_head_quantization("auto", plain.quant, plain.model.lm_head, CPU, lambda: True) == "none"
    awq = load_model(fixture_dir("awq_4bit_g64"), torch.bfloat16, None, CPU, lm_head_quantization="none")
    head = awq.model.lm_head
    assert resolve_head_quantization("auto", awq.quant, head, CPU, lambda: True) == "q8_0"
    assert resolve_head_quantization("auto", awq.quant, head, torch.device("cuda"), lambda: True) == "none"
    assert resolve_head_quantization("auto", awq.quant, head, CPU, lambda: False) == "none"  # no packed kernels
    assert resolve_head_quantization("none", awq.quant, head, CPU, lambda: True) == "none"
    tool_head = load_model(fixture_dir("gptq_4bit_g128_lm_head"), None, None, CPU, lm_head_quantization="auto")
    assert tool_head.lm_head_quantization == "none"  # the tool quantized it: kept as the checkpoint has it
    assert not isinstance(tool_head.model.lm_head.method, GgufLinearMethod)


def test_refusals_name_the_field() -> None:
    with pytest.raises(ConfigError, match="lm_head_quantization.*supported: auto, none, q8_0"):
        check_backends(EngineConfig(lm_head_quantization="q4_0"))  # names are checked where backends are built
    with pytest.raises(ConfigError, match="lm_head_quantization.*CPU only"):
        EngineConfig(lm_head_quantization="q8_0", device="cuda")
    with pytest.raises(ModelLoadError, match="lm_head_quantization.*GPTQ"):
        load_model(fixture_dir("gptq_4bit_g128_lm_head"), None, None, CPU, lm_head_quantization="q8_0")
