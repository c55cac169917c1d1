"""fp32 compute over a plain row-major fp32 weight at any row count (kernels/cpu/dense_rows.c,
quant/dense_native.dense_rows_gemm): against an fp64 reference at every core tier this host runs ("portable" has no
kernel and says so), a row's result bit for bit the same whatever rows are beside it (the 8-row and 16-row tiles,
row blocks, input chunks), and the routing of UnquantizedLinearMethod.apply (2-256 rows where the build routes them,
torch's sgemm otherwise), in a model whose greedy tokens still equal transformers'.

Bound: fp32 products summed in fp32 in one chain: |got - want| <= 2 n 2^-24 sum |x_k w_k| + |bias| 2^-24.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

import cpu_tiers
from conftest import hf_greedy, make_tiny_model
from pagedserve.engine import LLM, SamplingParams
from pagedserve.kernels.cpu.native import load_library
from pagedserve.quant.dense_layout import grouped_isa
from pagedserve.quant.dense_native import dense_native_linear, dense_rows_gemm, rows_gemm_routed
from pagedserve.quant.linear import QuantLinear
from pagedserve.quant.unquantized import UnquantizedLinearMethod

# (out, in): panels of 6 rows whole or not (a last panel of 1, 3, 5 rows), one input, odd inputs, past one input
# chunk of 512 with a partial last chunk, three whole chunks
SHAPES = [(48, 576), (7, 1), (13, 33), (50, 515), (6, 1536)]
# one row, the 8-row tile whole and not, the 16-row tile whole and not, several row blocks (in 1536: 32 rows each)
ROWS = (1, 2, 8, 9, 16, 17, 70)
TIERS = cpu_tiers.params(cpu_tiers.CORE)


def _operands(out: int, n_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out, n_in, generator=gen), torch.randn(out, generator=gen),
            torch.randn(max(ROWS), n_in, generator=gen))


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, what: str) -> None:
    xd, wd = x.double(), w.double()
    bd = bias.double() if bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    want = xd @ wd.T + bd
    bound = 2 * w.shape[1] * 2.0**-24 * (xd.abs() @ wd.abs().T) + 2.0**-24 * (want.abs() + bd.abs())
    excess = (got.double() - want).abs() - bound
    assert (excess <= 0).all(), f"{what}: max excess {excess.max().item():.3g}"


def _has_kernel(lib) -> bool:
    return lib.pagedserve_dense_gemm_isa(1, 0).decode() != "portable"  # built where the grouped kernels are


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("out,n_in", SHAPES)
def test_matches_the_reference(tier: str, out: int, n_in: int) -> None:
    lib = load_library(None if tier == "native" else tier)
    w, bias, x = _operands(out, n_in, out + n_in)
    for b in (bias, None):
        native = dense_native_linear(w, b, lib=lib)
        if not _has_kernel(lib):
            with pytest.raises(RuntimeError, match="status 1"):
                dense_rows_gemm(native, x, lib=lib)
            return
        for rows in ROWS:
            got = dense_rows_gemm(native, x[:rows], lib=lib)
            assert got.dtype == torch.float32 and got.shape == (rows, out)
            _check(got, x[:rows], w, b, f"{tier} {out}x{n_in} rows {rows} bias={b is not None}")


@pytest.mark.parametrize("tier", TIERS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(tier: str) -> None:
    """A batch's rows each get the bits they get alone: the 8-row tile (calls of up to 8) and the 16-row one sum
    in the same order, and so do row blocks and input chunks (1100 inputs: three chunks; 300 rows: several
    blocks)."""
    lib = load_library(None if tier == "native" else tier)
    if not _has_kernel(lib):
        pytest.skip("no kernel in the portable build")
    w, bias, _ = _operands(37, 1100, 4)
    x = torch.randn(300, 1100, generator=torch.Generator().manual_seed(5))
    native = dense_native_linear(w, bias, lib=lib)
    full = dense_rows_gemm(native, x, lib=lib)
    for r0, r1 in ((0, 1), (5, 6), (299, 300), (3, 11), (1, 9), (17, 50), (40, 130), (0, 299)):
        assert torch.equal(dense_rows_gemm(native, x[r0:r1], lib=lib), full[r0:r1]), f"{tier} rows {r0}:{r1}"


def test_bad_operands_are_refused() -> None:
    native = dense_native_linear(torch.zeros(12, 64), None)
    with pytest.raises(ValueError, match=r"x must be \[rows, 64\] fp32"):
        dense_rows_gemm(native, torch.zeros(3, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be \[rows, 64\]"):
        dense_rows_gemm(native, torch.zeros(3, 62))
    for weight in (torch.zeros(16, 64, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.float16)):
        with pytest.raises(RuntimeError, match="status -3"):  # not an fp32 weight
            dense_rows_gemm(dense_native_linear(weight, None), torch.zeros(3, 64))
    assert dense_rows_gemm(native, torch.zeros(0, 64)).shape == (0, 12)


def test_routed_only_in_builds_without_avx512() -> None:
    assert rows_gemm_routed() == (grouped_isa() == "avx2")


def _fp32_linear(out: int, n_in: int, shared: bool) -> QuantLinear:
    layer = QuantLinear(n_in, out, not shared, UnquantizedLinearMethod(), torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out, n_in, generator=torch.Generator().manual_seed(out)))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(out))
    layer.weight_shared = shared  # a tied head: stays plain, never packed beside the embedding's table
    layer.method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("shared", [False, True], ids=["packed", "tied-head"])
def test_apply_routes_2_to_256_rows_to_the_kernel(shared: bool) -> None:
    """A tied head (plain weight) takes the kernel from load; every other layer once the native step has made its
    weight plain (native_linear). Outside 2-256 rows, or where the build does not route it: torch's matmul."""
    layer = _fp32_linear(40, 96, shared)
    if not shared:
        assert layer.rows_gemm is None  # oneDNN's packed copy until native_linear turns it plain
        if layer.method.native_linear(layer) is None:
            pytest.skip("the native kernels do not build here")
    assert (layer.rows_gemm is not None) == rows_gemm_routed()
    x = torch.randn(300, 96, generator=torch.Generator().manual_seed(1))
    for rows in (1, 2, 64, 256, 257, 300):
        got = layer.method.apply(layer, x[:rows])
        if layer.rows_gemm is not None and 2 <= rows <= 256:
            assert torch.equal(got, dense_rows_gemm(layer.rows_gemm, x[:rows])), rows
        else:
            assert torch.equal(got, F.linear(x[:rows], layer.weight, layer.bias)), rows
    assert layer.method.apply(layer, x[:64].view(4, 16, 96)).shape == (4, 16, 40)


@pytest.mark.parametrize("native_step", [0, None], ids=["torch-path", "native-step"])
def test_fp32_models_greedy_tokens_equal_transformers(tmp_path, native_step):
    """Five sequences of 4-12 tokens: decode steps of 5 down to 1 sequences, on the torch path (the kernel where
    routed, the tied head too) or, with the native step at its own limit (3 where routed), natively below it."""
    from pagedserve.quant.native_linear import AVX2_DENSE_FP32_NATIVE_MAX_BATCH, DEFAULT_NATIVE_MAX_BATCH

    path = make_tiny_model(tmp_path, "LlamaForCausalLM", initializer_range=0.1, tie_word_embeddings=True)
    llm = LLM(str(path), dtype="float32", native_step_max_batch=native_step)
    prompts = [list(range(100 + 7 * i, 117 + 7 * i)) for i in range(5)]
    lengths = [4 + 2 * i for i in range(5)]
    out = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert llm.engine.runner.model.lm_head.rows_gemm is not None or not rows_gemm_routed()
    step = llm.engine.runner.native_step
    if native_step is None and step is not None:
        routed = rows_gemm_routed()
        assert step.capacity.max_batch == (AVX2_DENSE_FP32_NATIVE_MAX_BATCH if routed else DEFAULT_NATIVE_MAX_BATCH)
    for prompt, n, result in zip(prompts, lengths, out, strict=True):
        assert list(result.outputs[0].token_ids) == hf_greedy(hf, prompt, n)
