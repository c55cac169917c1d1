"""fp32 compute over a grouped bf16 weight (`--dtype auto` where the host has no bf16 arithmetic) at batch sizes past
the GEMV's (kernels/cpu/dense_rows.c, quant/dense_native.dense_rows_gemm): the group widened a chunk at a time and
multiplied as the plain fp32 path multiplies, so its results equal, bit for bit, the plain fp32 GEMM's over the
weight widened to fp32 (exact) at every row count and tier this host runs; that GEMM is held to an fp64 reference
in test_dense_rows.py. Then the routing of UnquantizedLinearMethod.apply: the GEMV's bits (GEMV and grouped GEMM)
while a speculative verify step may compare rows with one-row steps, this kernel for 13-512 rows once
`free_row_bits`; and an engine decoding 16 sequences through it whose greedy tokens equal transformers' fp32 ones.
"""

from __future__ import annotations

import pytest
import torch

import cpu_tiers
from conftest import hf_greedy, make_tiny_model
from pagedserve.kernels.cpu.native import load_library
from pagedserve.quant.dense_layout import chunked_linear, group_rows_in_place
from pagedserve.quant.dense_native import call_native_linear, dense_gemm, dense_native_linear, dense_rows_gemm
from pagedserve.quant.dense_native import rows_gemm_routed
from pagedserve.quant.linear import QuantLinear
from pagedserve.quant.unquantized import UnquantizedLinearMethod

# (out, in): one unit of 3 groups, one group of one input pair, 2 groups (a short unit) over a partial input chunk
# (128 + 128 + 2), 5 groups (a unit of 3, one of 2) over 130 inputs, 6 groups over 12 chunks
SHAPES = [(48, 576), (16, 2), (32, 258), (80, 130), (96, 1536)]
# one row, the 8-row tile whole and not, the 16-row tile whole and not, a last tile of at most 8 rows (its
# 8-row kernel), several row blocks
ROWS = (1, 2, 8, 9, 16, 17, 24, 25, 70, 300)
TIERS = cpu_tiers.params(cpu_tiers.CORE)


def _grouped(out: int, n_in: int, seed: int, lib=None, x_fp32: bool = True):
    gen = torch.Generator().manual_seed(seed)
    plain = torch.randn(out, n_in, generator=gen).bfloat16()
    bias = torch.randn(out, generator=gen)
    grouped = plain.clone()
    group_rows_in_place(grouped)
    return plain, bias, dense_native_linear(grouped, bias, lib=lib, x_fp32=x_fp32), grouped


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("out,n_in", SHAPES)
def test_equals_the_plain_gemm_over_the_widened_weight(tier: str, out: int, n_in: int) -> None:
    lib = load_library(None if tier == "native" else tier)
    if lib.pagedserve_dense_grouped_isa().decode() == "portable":
        pytest.skip("no grouped layout in the portable build")
    plain, bias, native, _ = _grouped(out, n_in, out + n_in, lib=lib)
    widened = dense_native_linear(plain.float(), bias, lib=lib)
    x = torch.randn(max(ROWS), n_in, generator=torch.Generator().manual_seed(7))
    for rows in ROWS:
        got = dense_rows_gemm(native, x[:rows], lib=lib)
        assert got.dtype == torch.float32 and got.shape == (rows, out)
        assert torch.equal(got, dense_rows_gemm(widened, x[:rows], lib=lib)), f"{tier} {out}x{n_in} rows {rows}"


def test_bf16_compute_states_are_refused() -> None:
    """A grouped weight made for bf16 compute (x rounded to bf16 first) is the grouped GEMM's, not this one's."""
    if load_library().pagedserve_dense_grouped_isa().decode() == "portable":
        pytest.skip("no grouped layout in this build")
    _, _, native, _ = _grouped(32, 64, 1, x_fp32=False)
    with pytest.raises(RuntimeError, match="status -3"):
        dense_rows_gemm(native, torch.zeros(20, 64))


def _bf16_weights_fp32_compute(out: int, n_in: int) -> QuantLinear:
    layer = QuantLinear(n_in, out, True, UnquantizedLinearMethod(torch.bfloat16), torch.float32)
    gen = torch.Generator().manual_seed(out)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out, n_in, generator=gen).bfloat16())
        layer.bias.copy_(torch.randn(out, generator=gen))
    layer.method.process_weights_after_loading(layer)
    return layer


def test_apply_keeps_the_gemv_bits_until_free_row_bits_then_routes_13_to_512_rows() -> None:
    layer = _bf16_weights_fp32_compute(64, 96)
    if layer.method.native_linear(layer) is None or layer.small_batch_gemv is None:
        pytest.skip("the native kernels do not build here")
    x = torch.randn(600, 96, generator=torch.Generator().manual_seed(2))
    counts = (1, 12, 13, 32, 33, 256, 512, 513)
    grouped = layer.weight.pagedserve_row_group != 0
    before = {rows: layer.method.apply(layer, x[:rows]) for rows in counts}
    layer.method.free_row_bits(layer)
    assert (layer.rows_gemm is not None) == (rows_gemm_routed() and grouped)
    for rows in counts:
        got = layer.method.apply(layer, x[:rows])
        if layer.rows_gemm is None:
            assert torch.equal(got, before[rows]), rows  # nothing changed
        elif rows <= 12:
            assert torch.equal(got, call_native_linear(layer.small_batch_gemv, x[:rows])), rows
        elif rows <= 512:
            assert torch.equal(got, dense_rows_gemm(layer.rows_gemm, x[:rows])), rows
        else:
            assert torch.equal(got, chunked_linear(x[:rows], layer.weight, layer.bias)), rows
    if grouped:  # before: the GEMV through 32 rows, the grouped GEMM (the GEMV's sums) to 256
        for rows in (1, 12, 32):
            assert torch.equal(before[rows], call_native_linear(layer.small_batch_gemv, x[:rows])), rows
        for rows in (33, 256):
            assert torch.equal(before[rows], dense_gemm(layer.small_batch_gemv, x[:rows])), rows


def test_sixteen_sequences_of_a_bf16_checkpoint_decode_as_transformers_fp32(tmp_path) -> None:
    """`--dtype auto` on this host: where it computes fp32 over bf16 weights (no bf16 arithmetic), 16 sequences
    prefill together and decode at 16 rows, past the native step's 8, through this kernel where routed; the greedy
    tokens are transformers' over the bf16 weights widened to fp32."""
    import transformers

    from pagedserve.engine import LLM, SamplingParams

    path = make_tiny_model(tmp_path, initializer_range=0.1)
    transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).save_pretrained(path)
    llm = LLM(str(path), kv_cache_memory=1 << 24, lm_head_quantization="none")
    if llm.engine.loaded.dtype != torch.float32:
        pytest.skip("this host computes a bf16 checkpoint in bf16 (it has bf16 arithmetic)")
    down = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert (down.rows_gemm is not None) == rows_gemm_routed()
    prompts = [[5 + i, 300 + 7 * i, 42, *range(900, 900 + i)] for i in range(16)]
    out = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    for prompt, result in zip(prompts, out, strict=True):
        assert list(result.outputs[0].token_ids) == hf_greedy(hf, prompt, 8)
