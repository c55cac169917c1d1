"""The native GPTQ/AWQ kernel (kernels/cpu/group_linear.c, quant/cpu_group_kernel.py) against the reference
dequantization (quant/group_quant.py, which tests/test_quant_fixtures.py checks against the tools' own outputs).

- Random weights of every supported bits x group combination, act-order or not, odd output counts and partial
  last groups, 1-17 activation rows, rows one after another and interleaved in groups of 16: the product within
  the layout's stated fp32 error bound of x @ W^T, the expanded matrix bit for bit; in every tier's build the host
  runs (AVX-512 with and without VNNI, AVX2, portable; the loader groups rows in the AVX2 and AVX-512 ones). The
  AVX2 interleaved kernel's outputs equal the fp32 AVX-512 one's bit for bit (the same sums per lane).
- Every quantized linear of the committed tool checkpoints: the kernel's expanded weights hash to the tool's own.
- The ps_linear pointer the native decode step calls, with a bias.
- The fixtures through the engine with the native decode step: logits of every position equal transformers' on
  the tools' dequantized weights (fp32), and the greedy tokens equal both transformers' and the torch path's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cpu_tiers
import engine_probe
from pagedserve.engine import LLM
from pagedserve.kernels.cpu import isa
from pagedserve.kernels.cpu import packed as cpu_packed
from pagedserve.quant.cpu_group_kernel import CpuGroupKernel, repack
from pagedserve.quant.dense_native import call_native_linear
from pagedserve.quant.packed_linear import PackedLinearMethod
from pagedserve.quant.packing import unpack_cols, unpack_rows
from quant_fixtures import (FIXTURE_NAMES, build_linear, dequantized_reference, fixture_dir, fp16_sha256,
                            grouped_logits_atol, quant_linears, random_weight, reference_weight, tool_record)

# The builds (kernels/cpu/isa.py tiers): avx512 is the AVX-512 build without VNNI+VBMI, what Skylake-SP and Cascade
# Lake run; avx2 and avx2_vnni what hosts without AVX-512 run; portable C.
TIERS = ("native", "avx512", "avx2_vnni", "avx2", "portable")
INT16_ISAS = ("avx512_vnni", "avx512", "avx2_vnni", "avx2")  # builds that round activations to int16 per run (act_q16.h)
CASES = [
    # (K, N, bits, group, act_order)
    (256, 128, 4, 128, False),
    (576, 192, 4, 128, True),  # SmolLM2's hidden size: the last group is partial (64 of 128)
    (160, 40, 4, 64, True),  # last group 32 of 64; N not a multiple of 16
    (512, 64, 4, -1, False),  # one group over all inputs
    (256, 32, 4, 32, True),
    (192, 64, 8, 64, True),
    (576, 24, 8, 32, False),
    (320, 48, 8, -1, False),
    (1536, 72, 8, 128, True),
]
ROWS = (1, 2, 3, 7, 8, 9, 17)


def _expected_isas(tier: str) -> tuple[str, str]:
    """What the row-after-row and the interleaved-rows GPTQ/AWQ kernels compile to in a tier's build."""
    tier = isa.host_tier() if tier == "native" else tier
    if tier.startswith("avx2"):
        return "avx2", tier
    grouped = tier if tier in ("avx512", "avx512_vnni") else "avx512_vnni" if tier == "avx512_bf16" else "portable"
    return ("avx512" if tier.startswith("avx512") else "portable"), grouped


@pytest.fixture(scope="module", params=cpu_tiers.params(TIERS))
def lib(request):
    built = cpu_packed.build(request.param)
    assert (cpu_packed.group_isa(built), cpu_packed.group_grouped_isa(built)) == _expected_isas(request.param)
    return built


def _in_checkpoint_order(matrix, w_sorted: torch.Tensor) -> torch.Tensor:
    if matrix.perm is None:
        return w_sorted
    out = torch.empty_like(w_sorted)
    out[:, matrix.perm.long()] = w_sorted
    return out


def _magnitudes(w) -> torch.Tensor:
    """(u + z) * s [out, in] in checkpoint order: what the grouped kernel's fp32 sums add up (it never forms u - z)."""
    g = w.g_idx.long()
    u = unpack_rows(w.qweight, w.bits).float()  # [in, out]
    return ((u + unpack_cols(w.qzeros, w.bits).float()[g]) * w.scales.float()[g]).t()


def _code_terms(w) -> torch.Tensor:
    """u * s [out, in] in checkpoint order: the part of each weight the int16 activations multiply."""
    g = w.g_idx.long()
    return (unpack_rows(w.qweight, w.bits).float() * w.scales.float()[g]).t()


def _rounding(m, x: torch.Tensor) -> torch.Tensor:
    """da / 2 per activation [rows, in] in checkpoint order: the int16 rounding's reach, da = max|x| / 32767 per
    run of 32 inputs in the weights' (act-order) input order, where the kernel rounds them."""
    order = m.perm.long() if m.perm is not None else torch.arange(x.shape[1])
    runs = x[:, order].reshape(x.shape[0], -1, 32)
    half = (runs.abs().amax(-1, keepdim=True) / 32767 / 2).expand_as(runs).reshape(x.shape)
    out = torch.empty_like(half)
    out[:, order] = half
    return out


def _bound(m, w, x: torch.Tensor) -> float:
    """The error the layout's product may have against exact x @ W^T. Row after row the weights are the reference's
    bit for bit: fp32 summation order, a few ulps of the largest partial sums. Grouped: per run s * sum(u x) +
    (-z s) * sum(x), so each of in/32 + 32 + a few roundings is relative to sums of (u + z) s |x| (the bound
    kernels/cpu/group_grouped.c states); the int16 builds also round x to int16 per run: + sum_k (da_k / 2) u_k s_k
    (kernels/cpu/act_q16.h's bound, with 0.1% for the rounding of da itself)."""
    if m.row_group == 0:
        return 2e-6 * (x.abs() @ w.dequantize(torch.float32).abs().t()).max().item()
    bound = (m.in_features // 32 + 40) * 2.0**-24 * (x.abs() @ _magnitudes(w).t())
    if cpu_packed.group_grouped_isa(m.lib) in INT16_ISAS:
        bound = bound + 1.001 * (_rounding(m, x) @ _code_terms(w).t())
    return bound.max().item()


@pytest.mark.parametrize("k,n,bits,group,act_order", CASES)
def test_product_and_expansion_equal_the_reference(lib, k, n, bits, group, act_order):
    w = random_weight(k, n, bits, group, act_order, seed=k + n)
    rowwise = dataclasses.replace(repack(w, group_rows=False), lib=lib)
    layouts = [rowwise] + ([rowwise.grouped()] if n % cpu_packed.GROUP_ROWS == 0 else [])
    reference = w.dequantize(torch.float32)
    g = torch.Generator().manual_seed(k)
    xs = [torch.randn(rows, k, generator=g) for rows in ROWS]
    for m in layouts:
        assert torch.equal(_in_checkpoint_order(m, m.dequantize(torch.float32)), reference), m.row_group
        assert torch.equal(_in_checkpoint_order(m, m.dequantize(torch.bfloat16)), reference.bfloat16())
        for x in xs:
            expected = x.double() @ reference.double().t()
            torch.testing.assert_close(m.matmul(x).double(), expected, rtol=0, atol=_bound(m, w, x))
        many = xs[-1]  # each row's result must not depend on the rows beside it (speculation verifies with it)
        full = m.matmul(many)
        for rows in range(1, min(many.shape[0], 10) + 1):
            assert torch.equal(m.matmul(many[:rows]), full[:rows]), (m.row_group, rows)


def test_the_8_lane_interleaved_kernels_equal_the_avx512_vnni_one_bit_for_bit():
    """Same int16 runs, integer dots and float epilogue per lane (act_q16.h), so the avx512, avx2 and avx2_vnni builds give
    the avx512_vnni build's outputs exactly, whichever of them this CPU runs (at least two are needed)."""
    tiers = [t for t in ("avx512_vnni", "avx512", "avx2_vnni", "avx2") if t in isa.available_tiers()]
    if len(tiers) < 2:
        pytest.skip(f"this CPU builds only {tiers} of the int16 tiers")
    libs = [cpu_packed.build(t) for t in tiers]
    for k, n, bits, group, act_order in CASES:
        if n % cpu_packed.GROUP_ROWS:
            continue
        rowwise = repack(random_weight(k, n, bits, group, act_order, seed=k), group_rows=False)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
        matrices = [dataclasses.replace(rowwise, lib=lib, bias=bias).grouped() for lib in libs]
        for rows in ROWS:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            want = matrices[0].matmul(x)
            for tier, m in zip(tiers[1:], matrices[1:]):
                assert torch.equal(m.matmul(x), want), (tier, k, n, bits, rows)


def test_rows_are_grouped_where_the_build_has_avx2_or_avx512_and_whole_groups():
    for n in (64, 40):
        fast = cpu_packed.group_grouped_isa(cpu_packed.build()).startswith(("avx512", "avx2"))
        m = repack(random_weight(256, n, 4, 64, True))
        assert m.row_group == (cpu_packed.GROUP_ROWS if fast and n % 16 == 0 else 0)
    rowwise = repack(random_weight(256, 40, 4, 64, True), group_rows=False)
    with pytest.raises(ValueError, match="grouped: needs a row-after-row matrix with a multiple of 16 rows, got 40"):
        rowwise.grouped()
    with pytest.raises(ValueError, match="row_group: 16 needs 0, or 16 with a multiple of 16 output rows"):
        dataclasses.replace(rowwise, row_group=16)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_tool_checkpoints_expand_to_the_tools_weights(name):
    record = tool_record(name)["dequant_fp16_sha256"]
    for prefix, digest in record.items():
        w = reference_weight(fixture_dir(name), prefix)
        for m in (repack(w), repack(w, group_rows=False)):
            assert fp16_sha256(_in_checkpoint_order(m, m.dequantize(torch.float32))) == digest, (name, prefix)
            x = torch.randn(3, w.in_features, generator=torch.Generator().manual_seed(1))
            reference = w.dequantize(torch.float32)
            torch.testing.assert_close(m.matmul(x), x @ reference.t(), rtol=0, atol=_bound(m, w, x))


def test_the_ps_linear_pointer_adds_the_bias_and_equals_the_kernel():
    w = random_weight(576, 192, 4, 128, True)
    kernel = CpuGroupKernel.from_weight(w, torch.float32)
    bias = torch.randn(192)
    native = kernel.native_linear(bias)
    assert (native.in_features, native.out_features) == (576, 192)
    for rows in (1, 4, 9):
        x = torch.randn(rows, 576)
        y = call_native_linear(native, x)
        assert torch.equal(y, kernel.matrix.matmul(x) + bias)
    assert CpuGroupKernel.from_weight(w, torch.float32).native_linear(None).state != native.state


def test_many_rows_take_the_expanded_matrix_with_the_same_result():
    w = random_weight(576, 192, 4, 128, True)
    kernel = CpuGroupKernel.from_weight(w, torch.float32)
    x = torch.randn(40, 576)
    reference = x.double() @ w.dequantize(torch.float32).double().t()
    bound = 2e-6 * (x.abs() @ w.dequantize(torch.float32).abs().t()).max().item()  # the expanded weights, exact
    torch.testing.assert_close(kernel(x).double(), reference, rtol=0, atol=bound)
    torch.testing.assert_close(kernel(x[:5]).double(), reference[:5], rtol=0, atol=_bound(kernel.matrix, w, x[:5]))
    y16 = kernel(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    assert (y16.double() - reference).abs().max().item() <= 2e-2 * reference.abs().max().item()


def test_layer_holds_only_the_repacked_bytes():
    name = "gptq_4bit_g128_actorder_sym"
    llm = LLM(str(fixture_dir(name)), dtype="float32")
    for prefix, layer in quant_linears(llm.engine.runner.model).items():
        assert isinstance(layer.qkernel, CpuGroupKernel) and isinstance(layer.method, PackedLinearMethod), prefix
        assert not any(hasattr(layer, t) for t in ("qweight", "qzeros", "scales", "g_idx")), prefix
        k, n = layer.in_features, layer.out_features
        # nibbles + fp16 scale and uint8 zero per (row, group of 128) + the int32 run map and permutation
        assert layer.qkernel.weight_nbytes() == k * n // 2 + n * -(-k // 128) * 3 + k // 32 * 4 + k * 4, prefix


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(5)
    return {f"p{i}": torch.randint(3, 128, (length,), generator=g).tolist() for i, length in enumerate((6, 17, 30))}


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixtures_through_the_native_decode_step(name, monkeypatch):
    hf = dequantized_reference(name)
    prompts, tokens = _prompts(), {}
    for limit in (8, 0):  # the native step for every decode step, then never (the torch path)
        # the head as stored: transformers' reference multiplies the checkpoint's own 16-bit head
        engine = LLM(str(fixture_dir(name)), dtype="float32", block_size=8, native_step_max_batch=limit,
                     lm_head_quantization="none").engine
        assert (engine.runner.native_step is not None) == (limit > 0)
        run = engine_probe.ProbeRun()
        with monkeypatch.context() as patch:
            engine_probe.attach(engine, run, patch)
            engine_probe.generate(engine, prompts, 16, run)
        assert (run.native_steps >= 10) == (limit > 0)
        engine_probe.assert_matches(run, hf, atol=grouped_logits_atol())
        tokens[limit] = run.tokens
    assert tokens[8] == tokens[0]
    for request_id, prompt in prompts.items():
        assert tokens[8][request_id][len(prompt):] == engine_probe.hf_greedy_tokens(hf, prompt, 16), request_id


@pytest.mark.parametrize("name", ["gptq_4bit_g128_actorder_sym", "gptq_8bit_g64_actorder_asym", "awq_4bit_g64"])
def test_merged_projections_equal_their_parts(name):
    prefixes = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    parts = [build_linear(fixture_dir(name), p, process=False) for p in prefixes]
    merged = parts[0].method.merge(parts)
    assert merged is not None
    merged.method.process_weights_after_loading(merged)
    for part in parts:
        part.method.process_weights_after_loading(part)
    x = torch.randn(3, parts[0].in_features)
    torch.testing.assert_close(merged(x), torch.cat([part(x) for part in parts], 1), rtol=0, atol=0)


def test_projections_with_different_act_order_stay_apart():
    prefixes = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    parts = [build_linear(fixture_dir("gptq_4bit_g128_actorder_sym"), p, process=False) for p in prefixes]
    parts[1].g_idx = parts[1].g_idx.flip(0).contiguous()  # another (still valid) channel order for k
    assert parts[0].method.merge(parts) is None


def test_bad_layouts_name_the_field():
    m = repack(random_weight(256, 64, 4, 128, True), group_rows=False)
    with pytest.raises(ValueError, match="codes: expected contiguous torch.uint8"):
        type(m)(m.bits, m.codes[:, :-1].contiguous(), m.scales, m.zeros, m.run_group, m.perm)
    with pytest.raises(ValueError, match="bits: 3"):
        type(m)(3, m.codes, m.scales, m.zeros, m.run_group, m.perm)
    with pytest.raises(ValueError, match="perm: expected"):
        type(m)(m.bits, m.codes, m.scales, m.zeros, m.run_group, m.perm.long())
    with pytest.raises(ValueError, match="in_features: 40 is not a multiple of 32"):
        repack(random_weight(40, 64, 4, 8, False))


def test_a_dtype_cast_of_the_module_leaves_the_kernel_intact():
    w = random_weight(256, 64, 4, 64, True)
    kernel = CpuGroupKernel.from_weight(w, torch.float32)
    x = torch.randn(2, 256)
    before = kernel(x)
    kernel.to(torch.bfloat16)  # converts floating-point buffers; the kernel's are integers, its scales its own
    assert torch.equal(kernel(x), before)
    assert kernel.weight_nbytes() == kernel.matrix.nbytes()
