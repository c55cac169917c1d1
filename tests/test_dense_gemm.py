"""The grouped bf16 layout at any row count (kernels/cpu/dense_gemm.c, dense_amx.c; quant/dense_native.dense_gemm):
against an fp64 reference over the same bf16 weights, at every tier this host runs (forced tiers compile no AMX)
and in the native build with AMX allowed and not; a row's result bit for bit the same whatever rows are beside it;
under fp32 compute the GEMV's own bits.

Bound: x rounded to bf16 (bf16 compute) or as it is (fp32 compute), products exact in fp32, sums in fp32 in some
order: |got - want| <= 4 n 2^-24 sum |x_k w_k| (+ |bias|), and for a bf16 output half a bf16 ulp more (2^-8 |want|).
"""

from __future__ import annotations

import pytest
import torch

import cpu_tiers
from pagedserve.kernels.cpu.native import load_library
from pagedserve.quant.dense_layout import group_rows_in_place
from pagedserve.quant.dense_native import call_native_linear, dense_gemm, dense_native_linear, gemm_isa

# (out, in): in a multiple of 32 or not (a partial last tile), one group, odd group counts, an input past AMX's
# input blocks (sums carried between blocks) with a partial last tile, the default model's fused q/k/v (960 x
# 576: past one AMX weight block of group pairs, so row tiles meet several blocks)
SHAPES = [(48, 576), (32, 30), (160, 2), (16, 4162), (80, 34), (960, 576)]
ROWS = (1, 2, 9, 17, 33, 300)
# The builds: the default (AMX where granted) and every forced tier (no AMX code), "portable" has no grouped GEMM.
TIERS = cpu_tiers.params(("native", "avx2", "avx512_bf16", "portable"))


def _grouped(out: int, n_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n_in, generator=gen).bfloat16()
    g = w.clone()
    group_rows_in_place(g)
    return w, g, torch.randn(out, generator=gen).bfloat16()


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, what: str) -> None:
    xd, wd, bd = x.double(), w.double(), bias.double()
    want = xd @ wd.T + bd
    bound = 4 * w.shape[1] * 2.0**-24 * (xd.abs() @ wd.abs().T + bd.abs())
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * want.abs()
    excess = (got.double() - want).abs() - bound
    assert (excess <= 0).all(), f"{what}: max excess {excess.max().item():.3g}"


def _library(tier: str):
    return load_library(None if tier == "native" else tier)


def _paths(tier: str) -> list[bool]:
    """allow_amx values worth running in this build: both where AMX is granted, else one."""
    lib = _library(tier)
    return [True, False] if gemm_isa(lib=lib) == "amx" else [True]


@pytest.mark.parametrize("tier", TIERS)
def test_forced_tiers_compile_no_amx(tier: str) -> None:
    lib = _library(tier)
    path = gemm_isa(lib=lib)
    assert gemm_isa(lib=lib, allow_amx=False) != "amx"
    if tier != "native":
        assert path == ("avx512_bf16" if tier == "avx512_bf16" else tier)  # PAGEDSERVE_CPU_ISA turns AMX off
        assert gemm_isa(x_fp32=True, lib=lib) == ("avx512" if tier.startswith("avx512") else tier)
    else:  # AMX where the build has it and the OS grants the tile state, else the tier's own code
        assert path == "amx" or path == gemm_isa(lib=lib, allow_amx=False)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("out,n_in", SHAPES)
def test_bf16_compute_matches_the_reference(tier: str, out: int, n_in: int) -> None:
    lib = _library(tier)
    w, g, bias = _grouped(out, n_in, out + n_in)
    native = dense_native_linear(g, bias, lib=lib)
    gen = torch.Generator().manual_seed(n_in)
    x = torch.randn(max(ROWS), n_in, generator=gen)
    if gemm_isa(lib=lib) == "portable":
        with pytest.raises(RuntimeError, match="status 1"):
            dense_gemm(native, x.bfloat16(), lib=lib)
        return
    for amx in _paths(tier):
        for rows in ROWS:
            for dtype in (torch.bfloat16, torch.float32):  # fp32 x is rounded to bf16 first, as the GEMV rounds it
                got = dense_gemm(native, x[:rows].to(dtype), lib=lib, allow_amx=amx)
                assert got.dtype == dtype and got.shape == (rows, out)
                _check(got, x[:rows].bfloat16(), w, bias, f"{tier} amx={amx} rows {rows} {dtype}")


@pytest.mark.parametrize("tier", TIERS)
def test_fp32_compute_is_the_gemv_bit_for_bit(tier: str) -> None:
    lib = _library(tier)
    if gemm_isa(x_fp32=True, lib=lib) == "portable":
        pytest.skip("no grouped layout in the portable build")
    for out, n_in in SHAPES[:3]:
        w, g, bias = _grouped(out, n_in, 3 * out + n_in)
        native = dense_native_linear(g, bias, lib=lib, x_fp32=True)
        x = torch.randn(67, n_in, generator=torch.Generator().manual_seed(out))
        got = dense_gemm(native, x, lib=lib)
        _check(got, x, w, bias, f"{tier} fp32 {out}x{n_in}")
        assert torch.equal(got, call_native_linear(native, x)), f"{tier} {out}x{n_in}"


@pytest.mark.parametrize("tier", TIERS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(tier: str) -> None:
    """Speculative decoding verifies several rows in one step and must get the rows' results as computed alone."""
    lib = _library(tier)
    if gemm_isa(lib=lib) == "portable":
        pytest.skip("no grouped layout in the portable build")
    # 336 outputs x 4162 inputs x 300 rows: under AMX several weight blocks, row blocks and input blocks at once
    _, g, bias = _grouped(336, 4162, 5)
    x = torch.randn(300, 4162, generator=torch.Generator().manual_seed(6)).bfloat16()
    for x_fp32 in (False, True):
        native = dense_native_linear(g, bias, lib=lib, x_fp32=x_fp32)
        xs = x.float() if x_fp32 else x
        for amx in _paths(tier):
            full = dense_gemm(native, xs, lib=lib, allow_amx=amx)
            for r0, r1 in ((0, 1), (5, 6), (69, 70), (3, 20), (17, 50), (1, 70), (130, 300), (299, 300)):
                part = dense_gemm(native, xs[r0:r1], lib=lib, allow_amx=amx)
                assert torch.equal(part, full[r0:r1]), f"{tier} x_fp32={x_fp32} amx={amx} rows {r0}:{r1}"


@pytest.mark.parametrize("out,n_in", [(192, 1536), (96, 576), (32, 2048)])
def test_amx_reads_bf16_x_in_place_as_it_reads_the_packed_copy(out: int, n_in: int) -> None:
    """bf16 x with in % 32 == 0 is read in place (a zero-padded copy of the last row tile only) unless its row
    stride is a multiple of 4 KB (2048 inputs: packed); fp32 x holding the same values is always packed: the same
    tiles, so the same bits. 530 rows: past one row block, a partial last tile, input blocks (1536 inputs)."""
    lib = _library("native")
    if gemm_isa(lib=lib) != "amx":
        pytest.skip("AMX tiles not granted here")
    _, g, bias = _grouped(out, n_in, 7)
    native = dense_native_linear(g, bias, lib=lib)
    x = torch.randn(530, n_in, generator=torch.Generator().manual_seed(8)).bfloat16()
    full = dense_gemm(native, x, lib=lib)
    assert torch.equal(full, dense_gemm(native, x.float(), lib=lib).bfloat16()), f"{out}x{n_in}"
    for r0, r1 in ((0, 1), (3, 20), (500, 530), (17, 529)):
        assert torch.equal(dense_gemm(native, x[r0:r1], lib=lib), full[r0:r1]), f"{out}x{n_in} rows {r0}:{r1}"


def test_bad_operands_are_refused() -> None:
    _, g, _ = _grouped(32, 64, 1)
    native = dense_native_linear(g, None)
    with pytest.raises(ValueError, match=r"x must be \[rows, 64\] fp32 or bf16"):
        dense_gemm(native, torch.zeros(3, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"x must be \[rows, 64\]"):
        dense_gemm(native, torch.zeros(3, 62))
    plain = dense_native_linear(torch.zeros(32, 64, dtype=torch.bfloat16), None)  # row-major: not the layout
    with pytest.raises(RuntimeError, match="status -3"):
        dense_gemm(plain, torch.zeros(3, 64, dtype=torch.bfloat16))
    assert dense_gemm(native, torch.zeros(0, 64)).shape == (0, 32)
