"""Unquantized linear layers on CPU run on oneDNN-packed weights: same results as F.linear, one copy in memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_model
from pagedserve.quant.linear import QuantLinear
from pagedserve.quant.onednn_dense import can_pack, pack_weight, packed_linear
from pagedserve.quant.unquantized import UnquantizedLinearMethod

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(1, 1)), reason="torch built without oneDNN")
# Accumulation order differs between MKL/oneDNN kernels; bf16 outputs are one rounding step apart at most.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# oneDNN packs bf16 only on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT; AVX2-only hosts keep F.linear for bf16.
PACKS_BF16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def loaded_layer(weight: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
    layer = QuantLinear(weight.shape[1], weight.shape[0], bias is not None, UnquantizedLinearMethod(), weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    layer.method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_layer_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    layer = loaded_layer(weight, bias)
    if dtype == torch.float32 or PACKS_BF16:
        assert layer.packed_weight is not None and layer.weight is None  # packed copy replaces the plain one
    else:
        assert layer.packed_weight is None and layer.weight is not None
    expected = F.linear(x.double(), weight.double(), bias.double())
    err = (layer(x).double() - expected).abs().max().item()
    assert err <= TOLERANCE[dtype] * max(1.0, expected.abs().max().item() / 8)


def test_leading_dims_and_non_contiguous_input_are_kept() -> None:
    weight = torch.randn(32, 48)
    packed = pack_weight(weight)
    x = torch.randn(4, 5, 96)[..., ::2]  # strided last dim
    out = packed_linear(x, packed, None)
    assert out.shape == (4, 5, 32)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_fp16_and_non_cpu_weights_keep_f_linear() -> None:
    layer = loaded_layer(torch.randn(8, 8).half(), None)
    assert layer.packed_weight is None and layer.weight is not None
    assert not can_pack(torch.zeros(2, 2, device="meta"))


def test_activation_dtype_must_match_packed_weight() -> None:
    packed = pack_weight(torch.randn(8, 8))
    with pytest.raises(AssertionError, match="activation torch.bfloat16"):
        packed_linear(torch.randn(2, 8).bfloat16(), packed, None)


def test_fused_projections_are_packed_and_the_tied_head_reads_the_table(tmp_path) -> None:
    from pagedserve.engine.loading.model_loader import load_model

    loaded = load_model(make_tiny_model(tmp_path, tie_word_embeddings=True), torch.float32, None, torch.device("cpu"))
    model = loaded.model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.packed_weight is not None
    assert layer.mlp.gate_up_proj.packed_weight is not None
    hidden = torch.randn(3, model.args.hidden_size)
    # The tied head is the embedding's own table, not a packed copy beside it (one copy of the vocabulary's weights).
    assert model.lm_head.packed_weight is None and model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.model.embed_tokens.weight),
                               rtol=1e-5, atol=1e-4)


def test_tied_head_native_linear_reads_the_embedding_in_place(tmp_path) -> None:
    from pagedserve.engine.loading.model_loader import load_model
    from pagedserve.quant.dense_native import call_native_linear

    loaded = load_model(make_tiny_model(tmp_path, tie_word_embeddings=True), torch.float32, None, torch.device("cpu"))
    model = loaded.model
    table = model.model.embed_tokens.weight
    assert model.lm_head.weight is table and model.lm_head.packed_weight is None
    native = model.lm_head.method.native_linear(model.lm_head)
    assert any(isinstance(t, torch.Tensor) and t.data_ptr() == table.data_ptr() for t in native.keepalive)
    hidden = torch.randn(2, model.args.hidden_size)
    torch.testing.assert_close(call_native_linear(native, hidden), F.linear(hidden, table), rtol=1e-5, atol=1e-4)
