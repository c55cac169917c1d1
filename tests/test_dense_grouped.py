"""The grouped-rows dense bf16 layout (quant/dense_layout.py, kernels/cpu/dense_grouped.c): the kernel against an
fp64 reference, a row's logits bit-identical alone or beside others, lookups through the grouped table equal the
row-major rows, the tied head regrouped in place (no second copy), the AVX2 build's grouped kernel equal to the
AVX-512 one's bit for bit, and a portable build keeping the row-major layout and kernel.

Reference: x rounded to bf16 (as the row-major kernel and the torch bf16 path round it), then an fp64 matmul;
products are exact in fp32 and only the summation order differs, so the bound is a few fp32 ulps of sum |x_k w_k|.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_model
import cpu_tiers
from pagedserve.kernels.cpu.native import load_library
from pagedserve.quant.dense_layout import (DenseEmbedding, can_group, embedding_rows, group_rows_in_place,
                                           grouped_isa, row_group)
from pagedserve.quant.dense_native import call_native_linear, dense_native_linear

HOST_GROUPS = grouped_isa() in ("avx512", "avx2")
needs_avx512 = pytest.mark.skipif(not HOST_GROUPS, reason="the grouped kernel is built only with AVX2 or AVX-512")
# (out, in): SmolLM2's head and MLP widths, odd widths, and shapes the grouped layout does not take (out % 16,
# odd in), which stay row-major.
SHAPES = [(160, 576), (48, 1536), (16, 2), (64, 34), (32, 30), (20, 64), (48, 33)]


def _weights(out: int, n_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n_in, generator=gen).bfloat16()
    return w, torch.randn(out, generator=gen).bfloat16()


def _grouped(w: torch.Tensor) -> torch.Tensor:
    g = w.clone()
    if can_group(g):
        group_rows_in_place(g)
    return g


@pytest.mark.parametrize("out,n_in", SHAPES)
def test_grouped_kernel_matches_reference(out: int, n_in: int) -> None:
    w, bias = _weights(out, n_in, out * 7 + n_in)
    g = _grouped(w)
    assert bool(row_group(g)) == (HOST_GROUPS and out % 16 == 0 and n_in % 2 == 0)
    gen = torch.Generator().manual_seed(n_in)
    for rows in (1, 2, 3, 4, 5, 8, 11):
        x = torch.randn(rows, n_in, generator=gen)
        for b in (None, bias):
            got = call_native_linear(dense_native_linear(g, b), x).double()
            xr = x.bfloat16().double()
            want = xr @ w.double().T + (0 if b is None else b.double())
            scale = xr.abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
            bound = 4 * n_in * 2.0**-24 * scale + 1e-30
            assert ((got - want).abs() <= bound).all(), f"rows {rows}: max excess {((got - want).abs() - bound).max()}"


@needs_avx512
@pytest.mark.parametrize("out,n_in", [(192, 576), (16, 64)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(out: int, n_in: int) -> None:
    """Speculative decoding verifies several rows in one step and must get exactly the one-row logits."""
    w, bias = _weights(out, n_in, 11)
    native = dense_native_linear(_grouped(w), bias)
    x = torch.randn(12, n_in, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([call_native_linear(native, x[r:r + 1]) for r in range(12)])
    for rows in range(2, 13):
        assert torch.equal(call_native_linear(native, x[:rows]), alone[:rows]), f"{rows} rows"


@needs_avx512
def test_grouping_is_in_place_and_lookups_read_the_original_rows() -> None:
    w, _ = _weights(96, 40, 3)
    embedding = DenseEmbedding(96, 40, torch.bfloat16)
    with torch.no_grad():
        embedding.weight.copy_(w)
    table = embedding.weight
    address = table.data_ptr()
    group_rows_in_place(table)
    group_rows_in_place(table)  # a second native step over the same tied head must not regroup it
    assert table.data_ptr() == address and row_group(table) == 16 and not torch.equal(table, w)
    ids = torch.tensor([0, 95, 17, 16, 15, 17, 48])
    assert torch.equal(embedding_rows(table, ids), w[ids])
    assert torch.equal(embedding_rows(table, ids.int()), w[ids]) and embedding_rows(table, ids[:0]).shape == (0, 40)
    assert torch.equal(embedding(ids.view(7, 1)), w[ids].view(7, 1, 40))


def test_groupless_matrices_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"cannot group a \(20, 64\)"):
        group_rows_in_place(torch.zeros(20, 64, dtype=torch.bfloat16))
    assert not can_group(torch.zeros(32, 64)) and not can_group(torch.zeros(32, 64, dtype=torch.float16))


@needs_avx512
def test_portable_kernel_refuses_a_grouped_weight() -> None:
    g = _grouped(_weights(32, 64, 1)[0])
    with pytest.raises(ValueError, match="portable kernel reads row-major weights only"):
        dense_native_linear(g, None, portable=True)


@pytest.mark.parametrize("tier", cpu_tiers.params(("avx2", "portable")))
def test_lower_tiers_row_major_and_grouped(tier: str) -> None:
    lib = load_library(tier)
    assert lib.pagedserve_dense_grouped_isa() == (b"avx2" if tier == "avx2" else b"portable")
    w, bias = _weights(48, 576, 2)
    gen = torch.Generator().manual_seed(9)
    g = _grouped(w)
    for rows in (1, 3, 5, 8, 11):
        x = torch.randn(rows, 576, generator=gen)
        xr = x.bfloat16().double()
        want = xr @ w.double().T + bias.double()
        bound = 4 * 576 * 2.0**-24 * (xr.abs() @ w.double().abs().T + bias.double().abs())
        got = call_native_linear(dense_native_linear(w, bias, lib=lib), x).double()
        assert ((got - want).abs() <= bound).all()
        if tier == "avx2" and row_group(g):  # the same sums per lane as the AVX-512 form: equal bit for bit
            grouped = call_native_linear(dense_native_linear(g, bias, lib=lib), x)
            assert ((grouped.double() - want).abs() <= bound).all()
            assert torch.equal(grouped, call_native_linear(dense_native_linear(g, bias), x)), rows


@needs_avx512
def test_tied_bf16_head_regroups_the_embedding_in_place(tmp_path) -> None:
    from pagedserve.engine.loading.model_loader import load_model

    loaded = load_model(make_tiny_model(tmp_path, tie_word_embeddings=True), torch.bfloat16, None,
                        torch.device("cpu"))
    model = loaded.model
    table = model.model.embed_tokens.weight
    original = table.detach().clone()
    ids = torch.tensor([[3, 49151], [16, 7]])
    looked_up = model.model.embed_tokens(ids)
    native = model.lm_head.method.native_linear(model.lm_head)
    assert row_group(table) == 16 and model.lm_head.weight is table  # regrouped in place: no second table
    assert any(isinstance(t, torch.Tensor) and t.data_ptr() == table.data_ptr() for t in native.keepalive)
    assert torch.equal(model.model.embed_tokens(ids), looked_up)
    hidden = torch.randn(3, model.args.hidden_size)
    want = F.linear(hidden.bfloat16().double(), original.double())
    torch.testing.assert_close(call_native_linear(native, hidden).double(), want, rtol=1e-5, atol=1e-4)
    # the torch path (prefill, large batches) reads the same regrouped table, through a row-major temporary
    torch.testing.assert_close(model.compute_logits(hidden.bfloat16()).double(), want, rtol=2e-2, atol=2e-2)
