"""The decode-layout repack and the w4a16 Triton kernels against the dequantized fp32 reference, and tinygemm's
conversion (the CUDA op's arithmetic checked through torch's CPU int4 op and a torch emulation).

Without CUDA, conftest sets TRITON_INTERPRET=1 and the kernels run under Triton's CPU interpreter; shapes are small
and odd (partial last groups, N not a multiple of the tile) to keep the suite fast.
"""

from __future__ import annotations

import pytest
import torch

from quant_fixtures import fixture_dir, random_weight, reference_weight

from pagedserve.quant import tinygemm, w4a16_layout
from pagedserve.quant.group_quant import GroupQuantWeight
from pagedserve.quant.qlinear_kernels import auto_kernel_order
from pagedserve.quant.w4a16_rule import W4A16Rule

w4a16_kernel = pytest.importorskip("pagedserve.quant.w4a16_kernel", reason="triton is not installed")
w4a16_triton = pytest.importorskip("pagedserve.quant.w4a16_triton", reason="triton is not installed")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _on(w: GroupQuantWeight, device: torch.device) -> GroupQuantWeight:
    return type(w)(w.qweight.to(device), w.qzeros.to(device), w.scales.to(device), w.g_idx.to(device), w.bits,
                   w.in_features, w.out_features)


def _check(w: GroupQuantWeight, m: int, dtype: torch.dtype, force: str | None = None, seed: int = 0) -> None:
    x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(seed + m))
    ref = x @ w.dequantize(torch.float32).t()
    kernel = w4a16_kernel.W4A16Kernel(_on(w, DEVICE))
    y = kernel(x.to(dtype).to(DEVICE), force=force).float().cpu()
    assert y.shape == ref.shape
    err = (y - ref).abs().max().item()
    assert err <= TOLERANCE[dtype] * ref.abs().max().item(), f"max abs err {err}"


@pytest.mark.parametrize("bits,k,n,group,act_order", [
    (4, 320, 72, 64, True),   # act-order, partial last group (320 = 5 groups), N not a multiple of 64
    (4, 200, 40, -1, False),  # one group, K not a multiple of the K tile
    (8, 208, 96, 32, True),   # 8-bit act-order, partial last group
])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_decode_kernel_matches_reference(bits, k, n, group, act_order, m):
    _check(random_weight(k, n, bits, group, act_order, seed=k + n + bits), m, torch.float32, "decode")


@pytest.mark.parametrize("bits,k,n,group,act_order", [
    (4, 320, 72, 64, True),   # act-order (gathered in the kernel), partial last group, N not a multiple of the tile
    (4, 200, 40, -1, False),  # one group, K not a multiple of the K tile
    (8, 208, 96, 32, True),   # 8-bit act-order, partial last group
    (4, 1024, 24, 128, False),  # several K splits
])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("path", ["gemv", "gemv_serial"])
def test_gemv_matches_reference(bits, k, n, group, act_order, m, path):
    _check(random_weight(k, n, bits, group, act_order, seed=k + n + bits), m, torch.float32, path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_16bit_activations(dtype):
    _check(random_weight(256, 64, 4, 128, True, seed=9), 2, dtype, "gemv")


def test_gemv_refuses_more_rows_than_its_accumulator():
    from pagedserve.quant import w4a16_gemv
    w = w4a16_kernel.W4A16Kernel(_on(random_weight(64, 16, 4, 32, False, seed=1), DEVICE))
    with pytest.raises(ValueError, match="rows"):
        w4a16_gemv.gemv(torch.zeros(17, 64, device=DEVICE), w.layout())


@pytest.mark.parametrize("bits,k,n,group,act_order", [
    (4, 320, 72, 64, True),   # act-order (gathered in the kernel), partial last group, N not a multiple of the tile
    (4, 200, 40, -1, False),  # one group, K not a multiple of the span
    (8, 208, 96, 48, True),   # 8-bit act-order, a group length that is no power of two: 16-row spans
    (4, 1024, 24, 128, False),  # many spans adding into one tile
])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("path", ["splitk_last", "splitk_atomic"])
def test_splitk_gemv_matches_reference(bits, k, n, group, act_order, m, path):
    _check(random_weight(k, n, bits, group, act_order, seed=k + n + bits), m, torch.float32, path)


@pytest.mark.parametrize("bits,k,n,group,act_order", [
    (4, 320, 72, 64, True), (4, 200, 40, -1, False), (8, 208, 96, 48, True), (4, 1024, 24, 128, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_splitk_fields_masked_in_place_match_reference(bits, k, n, group, act_order, dtype):
    """The one-row variant that masks each field where it lies (the fields past the mantissa from the word shifted
    once, the zero point per span): 4 and 8 bits, act-order, partial and odd groups, one group."""
    from pagedserve.quant import w4a16_splitk

    w = random_weight(k, n, bits, group, act_order, seed=k + n + bits)
    kernel = w4a16_kernel.W4A16Kernel(_on(w, DEVICE))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    ref = x.float() @ w.dequantize(torch.float32).t()
    y = kernel.splitk(x.to(DEVICE), w4a16_splitk.SplitKConfig(block_n=32, unpack=True, in_place=True)).float().cpu()
    assert (y - ref).abs().max().item() <= TOLERANCE[dtype] * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("path", ["splitk_last", "splitk_atomic"])  # bf16 takes "last" either way
def test_splitk_gemv_16bit_activations(dtype, m, path):
    _check(random_weight(256, 64, 4, 128, True, seed=9), m, dtype, path)


def _sweep_configs():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    import bench_w4a16
    from pagedserve.quant import w4a16_splitk

    return [w4a16_splitk.SplitKConfig(*c) for c in bench_w4a16.SPLITK_SWEEP]


@pytest.mark.parametrize("index", range(24))
def test_every_benched_splitk_launch_matches_reference(index):
    """Each launch setting the device bench times computes the layer's product (and leaves its workspace zero), so
    the fastest can become the default without a correctness question."""
    configs = _sweep_configs()
    assert len(configs) == 24, "keep this test's range equal to the sweep's length"
    cfg = configs[index]
    w = random_weight(512, 80, 4, 128, True, seed=21)
    kernel = w4a16_kernel.W4A16Kernel(_on(w, DEVICE))
    dense = w.dequantize(torch.float32)
    wide = ((cfg.block_m - 3, torch.float16),) if cfg.block_m > 16 else ()  # the rows it is timed at
    for m, dtype in ((1, torch.float16), (1, torch.float32), (5, torch.float16), *wide):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(dtype)
        ref = x.float() @ dense.t()
        y = kernel.splitk(x.to(DEVICE), cfg).float().cpu()
        assert (y - ref).abs().max().item() <= TOLERANCE[dtype] * ref.abs().max().item(), (cfg.name, m, dtype)
    assert not kernel.workspace().sums.any() and not kernel.workspace().counts.any()


def test_splitk_last_reduction_leaves_workspace_zero_and_rule():
    from pagedserve.quant import w4a16_splitk

    w = random_weight(1024, 40, 4, 128, False, seed=3)
    kernel = w4a16_kernel.W4A16Kernel(_on(w, DEVICE))
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    first = kernel(x, force="splitk_last")
    ws = kernel.workspace()
    assert not ws.sums.any() and not ws.counts.any()  # the next call (or graph replay) starts clean
    torch.testing.assert_close(kernel(x, force="splitk_last"), first, rtol=1e-6, atol=1e-6)
    assert w4a16_splitk.span_for(kernel.layout(), w4a16_splitk.SplitKConfig(block_k=32, k_steps=8)) == (32, 4)
    with pytest.raises(ValueError, match="rows"):
        w4a16_splitk.splitk_gemv(torch.zeros(17, 1024, device=DEVICE), kernel.layout(), ws)
    with pytest.raises(ValueError, match="SplitKWorkspace"):
        w4a16_splitk.splitk_gemv(x, kernel.layout(), None)
    with pytest.raises(ValueError, match="at least 40 columns"):  # a workspace narrower than the layer
        w4a16_splitk.splitk_gemv(x, kernel.layout(), w4a16_splitk.SplitKWorkspace(16, DEVICE))
    with pytest.raises(ValueError, match="reduce"):
        w4a16_splitk.SplitKConfig(reduce="tree")
    rule = W4A16Rule(splitk_max_m=16)
    assert rule.path(16, torch.float16, True) == "splitk" and rule.path(17, torch.bfloat16, True) == "tinygemm"
    assert rule.path(1, torch.float32, True) == "splitk"  # fp32: one row on the CUDA cores, more through fp32 dots
    wider = w4a16_kernel.W4A16Kernel(_on(random_weight(64, 72, 4, 32, False, seed=1), DEVICE))
    assert kernel.workspace() is wider.workspace() and wider.workspace().columns >= 72  # one, grown to the widest
    with pytest.raises(Exception, match="splitk_max_m"):
        W4A16Rule(splitk_max_m=17)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
def test_decode_kernel_16bit_activations(dtype, m):
    _check(random_weight(256, 64, 4, 128, True, seed=9), m, dtype, "decode")


def test_split_k_partial_sums_and_dense_path():
    w = random_weight(384, 48, 4, 32, True, seed=4)
    x = torch.randn(3, 384, generator=torch.Generator().manual_seed(1))
    ref = x @ w.dequantize(torch.float32).t()
    layout = w4a16_layout.repack(_on(w, DEVICE))
    xs = x.index_select(1, layout.perm.cpu()).contiguous().to(DEVICE)
    y = w4a16_triton.decode_gemm(xs, layout, splits=3).cpu()  # 3 splits of 128 rows, 4 groups each
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    locks = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the counters are reset by the kernel: a second call reduces again
        y = w4a16_triton.decode_gemm(xs, layout, splits=3, locks=locks).cpu()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        assert int(locks.abs().sum()) == 0
    _check(w, 3, torch.float32, "dense")
    _check(w, 3, torch.float16, "dense")
    _check(w, 70, torch.float16, "decode")  # the prefill-sized tile of the launch table (bench only)


@pytest.mark.parametrize("bits,group,act_order,dtype", [(4, 64, True, torch.float32), (8, 32, False, torch.float16)])
def test_dense_path_by_column_chunks(bits, group, act_order, dtype):
    """Dequantized and multiplied 64 columns at a time through one buffer (a partial last chunk: N = 200), every
    chunk written into its slice of the output: the reference, and the whole-tile path's values."""
    w = random_weight(320, 200, bits, group, act_order, seed=11)
    layout = w4a16_layout.repack(_on(w, DEVICE))
    x = torch.randn(5, 320, generator=torch.Generator().manual_seed(2))
    ref = x @ w.dequantize(torch.float32).t()
    xs = (x if layout.perm is None else x.index_select(1, layout.perm.cpu())).contiguous().to(DEVICE, dtype)
    chunked = w4a16_kernel.dense_by_chunks(xs, layout, 320 * xs.element_size() * 64).float().cpu()
    whole = w4a16_kernel.dense_by_chunks(xs, layout, 1 << 30).float().cpu()
    scale = ref.abs().max().item()
    assert (chunked - ref).abs().max().item() <= TOLERANCE[dtype] * scale
    torch.testing.assert_close(chunked, whole, rtol=0, atol=TOLERANCE[dtype] * scale / 4)
    _check(w, 5, dtype, "dense_chunked")
    _check(w, 5, dtype, "dense_chunked_75")


def test_awq_tool_checkpoint_through_decode_layout():
    w = reference_weight(fixture_dir("awq_4bit_g64"), "model.layers.0.self_attn.q_proj")
    for m in (1, 3):
        _check(w, m, torch.float32, "decode")


def test_repack_keeps_the_weight_and_refuses_irregular_groups():
    w = random_weight(96, 16, 4, 32, True, seed=2)
    layout = w4a16_layout.repack(w)
    assert layout.group_size == 32 and layout.perm is not None
    dense = w.dequantize(torch.float32)
    torch.testing.assert_close(layout.dequantize(torch.float32), dense.index_select(1, layout.perm), rtol=0, atol=0)
    odd = GroupQuantWeight(w.qweight, w.qzeros, w.scales, torch.tensor([0] * 40 + [1] * 24 + [2] * 32,
                                                                      dtype=torch.int32), 4, 96, 16)
    assert "uniform" in w4a16_layout.unsupported_reason(odd)


@pytest.mark.parametrize("group,k", [(64, 256), (-1, 512)])
def test_tinygemm_conversion_matches_reference(group, k):
    """Scale/zero conversion and packing order, through torch's CPU int4 op (same (q - 8) * s + zero formula as the
    CUDA one) and a torch emulation; tolerance: bf16 scales, zeros and activations."""
    w = random_weight(k, 32, 4, group, True, seed=k)
    assert tinygemm.unsupported_reason(w) is None
    layout = w4a16_layout.repack(w)
    tg_group, sz = tinygemm.scales_and_zeros(layout)
    values = tinygemm.int4_values(layout)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    xs = x if layout.perm is None else x.index_select(1, layout.perm)
    ref = x.float() @ w.dequantize(torch.float32).t()
    tol = 1e-2 * ref.abs().max().item()
    assert (tinygemm.emulate(xs, values, tg_group, sz) - ref).abs().max().item() <= tol
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, tinygemm.inner_k_tiles(k))
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(xs, packed, tg_group, sz).float()
    assert (got - ref).abs().max().item() <= tol
    nibbles = tinygemm.cuda_input(values)
    assert torch.equal(((nibbles.to(torch.int32) >> 4) & 15), values[:, ::2])
    assert torch.equal(nibbles.to(torch.int32) & 15, values[:, 1::2])


def test_tinygemm_refusals_and_rule():
    assert "4-bit" in tinygemm.unsupported_reason(random_weight(256, 32, 8, 64, False))
    assert "multiple of 32" in tinygemm.unsupported_reason(random_weight(200, 32, 4, -1, False))
    assert "group size 48" in tinygemm.unsupported_reason(random_weight(192, 32, 4, 48, False))
    assert auto_kernel_order(torch.device("cuda"), torch.float16)[:2] == ("vendor", "w4a16")
    rule = W4A16Rule()
    assert rule.path(1, torch.float16, True) == rule.path(16, torch.bfloat16, False) == "splitk"
    assert rule.path(17, torch.bfloat16, True) == "tinygemm" and rule.path(63, torch.bfloat16, True) == "tinygemm"
    assert rule.path(17, torch.float16, True) == "dense"  # fp16 is not cast to bf16 for tinygemm
    assert rule.path(64, torch.bfloat16, True) == "dense" and rule.path(17, torch.float32, True) == "dense"
    assert rule.path(17, torch.bfloat16, False) == "dense"
    assert W4A16Rule(tinygemm_fp16=True, splitk_max_m=0).path(1, torch.float16, True) == "tinygemm"
    assert W4A16Rule(splitk_max_m=0, gemv_max_m=4, tile_max_m=32).path(8, torch.float16, False) == "decode"
    with pytest.raises(Exception, match="gemv_max_m"):
        W4A16Rule(gemv_max_m=17)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_serves_decode_rows_through_tinygemm_and_prefill_dense(dtype):
    """The rule's default paths on a 4-bit group-128 layer: the split-K GEMV to 16 rows, tinygemm for bf16 to 63
    (torch's CPU op here), the decode layout's dequantize + matmul from 64 (fp16 from 17): each the layer's
    product; tinygemm's copy of the weight is kept only for a model dtype the rule gives it to."""
    w = random_weight(256, 64, 4, 128, True, seed=5)
    kernel = w4a16_kernel.W4A16Kernel(w)
    assert kernel.small is not None
    assert w4a16_kernel.W4A16Kernel(w, torch.float16).small is None
    assert w4a16_kernel.W4A16Kernel(w, torch.bfloat16).small is not None
    dense = w.dequantize(torch.float32)
    for m in (1, 5, 20, 64):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
        y = kernel(x).float()
        assert y.dtype == torch.float32 and y.shape == (m, 64)
        ref = x.float() @ dense.t()
        assert (y - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    assert w4a16_kernel.W4A16Kernel(random_weight(256, 64, 8, 128, False, seed=5)).small is None  # 8-bit: dense


def test_tinygemm_kernel_module_on_cpu_op():
    """The kernel class end to end (act-order permutation, fp16 in and out) through the CPU variant of the op."""
    w = random_weight(256, 48, 4, 128, True, seed=12)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2)).half()
    ref = x.float() @ w.dequantize(torch.float32).t()
    y = tinygemm.TinyGemmKernel(w)(x)
    assert y.dtype == torch.float16
    assert (y.float() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
