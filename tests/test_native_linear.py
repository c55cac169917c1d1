"""The dense native linear (kernels/cpu/dense_linear.c) against an fp32 reference, and the unquantized method's
`native_linear` against its own torch `apply`.

Reference: x rounded to the weight's dtype, then an fp64 matmul; the kernel's products are exact in fp32 and only
its summation order differs, so the bound is a few fp32 ulps of sum |x_k w_k|. The AVX512-BF16 code runs where
the host has it; the portable code (what other hosts run) is tested on every host.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.quant.dense_native import call_native_linear, dense_native_linear
from pagedserve.quant.linear import QuantLinear
from pagedserve.quant.unquantized import UnquantizedLinearMethod

SHAPES = [(1, 16, 4), (3, 64, 7), (8, 576, 960), (9, 100, 33), (5, 1536, 576), (2, 31, 5), (16, 96, 130)]


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    xr = x.to(w.dtype).double()
    y = xr @ w.double().T
    scale = xr.abs() @ w.double().abs().T  # sum |x w|: what the fp32 rounding error scales with
    if bias is not None:
        y = y + bias.double()
        scale = scale + bias.double().abs()
    return y, scale


@pytest.mark.parametrize("portable", [False, True], ids=["host", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,n_in,n_out", SHAPES)
def test_dense_linear_matches_reference(rows: int, n_in: int, n_out: int, dtype: torch.dtype, portable: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n_in + n_out)
    w = torch.randn(n_out, n_in, generator=gen).to(dtype)
    bias = torch.randn(n_out, generator=gen).to(dtype) if n_out % 2 else None
    x = torch.randn(rows, n_in, generator=gen)
    got = call_native_linear(dense_native_linear(w, bias, portable=portable), x).double()
    want, scale = _reference(x, w, bias)
    bound = 4 * n_in * 2.0**-24 * scale + 1e-30
    assert ((got - want).abs() <= bound).all(), f"max excess {((got - want).abs() - bound).max().item():.3e}"


def test_host_and_portable_code_agree_on_a_real_shape() -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(3072, 576, generator=gen).bfloat16()
    x = torch.randn(4, 576, generator=gen)
    host = call_native_linear(dense_native_linear(w, None), x)
    portable = call_native_linear(dense_native_linear(w, None, portable=True), x)
    assert torch.allclose(host, portable, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unquantized_method_native_linear_matches_apply(dtype: torch.dtype) -> None:
    """After loading (oneDNN-packed where it can), the native linear computes what `apply` computes."""
    gen = torch.Generator().manual_seed(3)
    layer = QuantLinear(192, 320, True, UnquantizedLinearMethod(), dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(320, 192, generator=gen))
        layer.bias.copy_(torch.randn(320, generator=gen))
    layer.method.process_weights_after_loading(layer)
    native = layer.method.native_linear(layer)
    assert native is not None and (native.in_features, native.out_features) == (192, 320)
    x = torch.randn(6, 192, generator=gen).to(dtype)
    torch_out = layer(x).float()
    got = call_native_linear(native, x.float())
    # the torch path rounds its output to the compute dtype; the native one keeps fp32
    tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got, torch_out, rtol=tol, atol=tol * torch_out.abs().max().item())


def test_bad_weight_names_the_problem() -> None:
    with pytest.raises(ValueError, match="weight must be a 2-D CPU tensor"):
        dense_native_linear(torch.zeros(4, 4, dtype=torch.int8), None)
    with pytest.raises(ValueError, match="bias must be"):
        dense_native_linear(torch.zeros(4, 4), torch.zeros(3))
