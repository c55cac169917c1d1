"""One copy of a dense checkpoint's weights (quant/unquantized.py's native_linear): with the native decode step
built, every unquantized linear's native kernel reads the layer's own weight tensor (same storage, not a copy), no
oneDNN packed copy is left beside it, and the torch path still computes with it (the greedy tokens equal
transformers' in fp32; the native step's and the torch path's logits agree in bf16). Without a native step, a tied
head is the embedding's table too (never packed beside it). Memory is checked by storage identity, not by a
resident-set figure (benchmarks/dense_memory.py measures that)."""

from __future__ import annotations

import pytest
import torch
import transformers

from conftest import hf_greedy, make_tiny_model
from pagedserve.engine import LLM, SamplingParams
from pagedserve.quant.dense_layout import chunked_linear, group_rows_in_place, grouped_isa, row_group, row_major
from pagedserve.quant.linear import QuantLinear
from pagedserve.quant.unquantized import UnquantizedLinearMethod


def _dense_layers(model) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules()
            if isinstance(m, QuantLinear) and isinstance(m.method, UnquantizedLinearMethod)}


def _native_weights(step) -> set[int]:
    """data_ptr of every tensor the native step's linears keep alive."""
    return {t.data_ptr() for n in step._keep for t in getattr(n, "keepalive", ()) if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_native_step_reads_the_models_own_weights(tmp_path, dtype, tied):
    path = make_tiny_model(tmp_path, "LlamaForCausalLM", initializer_range=0.1, tie_word_embeddings=tied)
    engine = LLM(str(path), dtype=dtype, native_step_max_batch=8).engine
    step = engine.runner.native_step
    assert step is not None
    layers = _dense_layers(engine.runner.model)
    assert layers
    native = _native_weights(step)
    for name, layer in layers.items():
        assert layer.packed_weight is None, name  # no oneDNN copy beside the plain weight
        assert layer.weight is not None and layer.weight.data_ptr() in native, name
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    distinct = {p.data_ptr(): p.numel() * p.element_size() for p in engine.runner.model.parameters()}
    assert sum(distinct.values()) == weight_bytes or tied  # a tied head's weight is the embedding's: counted once
    if tied:
        head = engine.runner.model.lm_head
        assert head.weight.data_ptr() == engine.runner.model.model.embed_tokens.weight.data_ptr()


def test_the_torch_path_reads_a_regrouped_weight_as_the_row_major_one(tmp_path):
    path = make_tiny_model(tmp_path, "LlamaForCausalLM", initializer_range=0.1)
    engine = LLM(str(path), dtype="bfloat16", native_step_max_batch=8).engine
    assert engine.runner.native_step is not None
    layers = _dense_layers(engine.runner.model)
    assert any(row_group(layer.weight) for layer in layers.values()) == (grouped_isa() != "portable")
    g = torch.Generator().manual_seed(0)
    for name, layer in layers.items():
        plain = row_major(layer.weight).clone()
        if row_group(layer.weight):  # the temporary is the layout's inverse: regrouping it gives the weight back
            group_rows_in_place(plain)
            assert torch.equal(plain.view(torch.int16), layer.weight.view(torch.int16)), name
            plain = row_major(layer.weight).clone()
        # A few rows go through the native GEMV, more through the grouped GEMM (kernels/cpu/dense_gemm.c), both over
        # the regrouped weight as it is: fp32 sums of the same bf16 products, rounded once to bf16, so within a bf16
        # rounding of the fp32 reference.
        x = torch.randn(40, layer.in_features, generator=g).bfloat16()
        reference = torch.nn.functional.linear(x.float(), plain.float(),
                                               None if layer.bias is None else layer.bias.float())
        for rows in (5, 40):
            got = layer.method.apply(layer, x[:rows])
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), reference[:rows], rtol=1e-2, atol=1e-2, msg=name)


@pytest.mark.parametrize("torch_bf16_gemm", [False, True], ids=["no-bf16-gemm-in-torch", "bf16-gemm-in-torch"])
def test_large_bf16_calls_leave_torch_only_where_it_has_a_bf16_gemm(tmp_path, monkeypatch, torch_bf16_gemm):
    """Past the GEMM's 256 rows a bf16 call takes F.linear's slices where torch multiplies bf16 through oneDNN, and
    stays on the grouped GEMM where it cannot (an AVX2-only host: torch's reference bf16 kernel ran 5-8x slower
    there); AMX's GEMM takes every row count either way."""
    from pagedserve.quant import unquantized
    from pagedserve.quant.dense_native import dense_gemm, gemm_isa

    if grouped_isa() == "portable":
        pytest.skip("no grouped layout in this build (a host without AVX2)")
    monkeypatch.setattr(unquantized, "has_onednn_bf16", lambda: torch_bf16_gemm)
    path = make_tiny_model(tmp_path, "LlamaForCausalLM", initializer_range=0.1)
    engine = LLM(str(path), dtype="bfloat16", native_step_max_batch=8).engine
    layers = [layer for layer in _dense_layers(engine.runner.model).values() if row_group(layer.weight)]
    assert layers
    on_gemm = not torch_bf16_gemm or gemm_isa() == "amx"
    g = torch.Generator().manual_seed(3)
    for layer in layers:
        x = torch.randn(300, layer.in_features, generator=g).bfloat16()
        want = (dense_gemm(layer.small_batch_gemv, x) if on_gemm else chunked_linear(x, layer.weight, layer.bias))
        assert torch.equal(layer.method.apply(layer, x), want)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_small_calls_keep_the_gemvs_bits_only_where_drafts_are_verified(tmp_path, speculative):
    """9-32 rows: with speculative decoding the GEMV (a verify step's rows then equal the one-row steps'), without
    it AMX's GEMM where granted (faster; each row still independent of its neighbours), else the GEMV."""
    from pagedserve.engine.spec_decode.config import SpeculativeConfig
    from pagedserve.quant.dense_native import call_native_linear, dense_gemm, gemm_isa

    path = make_tiny_model(tmp_path, "LlamaForCausalLM", initializer_range=0.1)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2) if speculative else None
    engine = LLM(str(path), dtype="bfloat16", native_step_max_batch=8, speculative=spec).engine
    layers = [layer for layer in _dense_layers(engine.runner.model).values() if layer.small_batch_gemv is not None]
    assert layers
    amx = not speculative and gemm_isa() == "amx"
    g = torch.Generator().manual_seed(2)
    for layer in layers:
        x = torch.randn(16, layer.in_features, generator=g).bfloat16()
        got = layer.method.apply(layer, x)
        gemv = call_native_linear(layer.small_batch_gemv, x.float()).bfloat16()
        want = dense_gemm(layer.small_batch_gemv, x) if amx else gemv
        assert torch.equal(got, want)
        assert torch.equal(layer.method.apply(layer, x[:8]), gemv[:8])  # up to 8 rows: the GEMV on every path
        if amx:  # one row's result whatever rows are beside it
            assert torch.equal(layer.method.apply(layer, x[3:12]), got[3:12])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_path_holds_a_tied_head_once(tmp_path, dtype):
    path = make_tiny_model(tmp_path, "LlamaForCausalLM", initializer_range=0.1, tie_word_embeddings=True)
    llm = LLM(str(path), dtype=dtype, native_step_max_batch=0)
    model = llm.engine.runner.model
    assert llm.engine.runner.native_step is None
    table = model.model.embed_tokens.weight
    assert model.lm_head.packed_weight is None and model.lm_head.weight.data_ptr() == table.data_ptr()
    for name, layer in _dense_layers(model).items():  # every other linear: one copy, packed or plain
        assert (layer.packed_weight is None) != (layer.weight is None) or layer is model.lm_head, name
    if dtype == "float32":  # the head's plain matmul keeps transformers' greedy tokens
        prompt = list(range(100, 120))
        out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        assert list(out[0].outputs[0].token_ids) == hf_greedy(hf, prompt, 8)


@pytest.mark.skipif(grouped_isa() == "portable", reason="this build keeps the row-major layout")
def test_grouped_linear_makes_the_weight_row_major_a_slice_at_a_time():
    g = torch.Generator().manual_seed(1)
    plain = torch.randn(8208, 512, generator=g).bfloat16()  # 8.4 MB: two whole 4 MiB slices and a part
    bias = torch.randn(8208, generator=g).bfloat16()
    grouped = plain.clone()
    group_rows_in_place(grouped)
    x = torch.randn(3, 512, generator=g).bfloat16()
    assert torch.equal(chunked_linear(x, grouped, bias), torch.nn.functional.linear(x, plain, bias))
