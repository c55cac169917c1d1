"""The w4a16 decode kernel and the tinygemm candidate compiled on a GPU: model-sized and odd shapes, act-order,
partial last groups, one group, 4 and 8 bits, every row bucket of the launch table, and CUDA-graph capture.

Marked `gpu` and skipped without CUDA. tests/test_w4a16.py's kernel cases run compiled too, from
test_interpreter_cases_gpu.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

w4a16_kernel = pytest.importorskip("pagedserve.quant.w4a16_kernel", reason="triton is not installed")

from quant_fixtures import random_weight  # noqa: E402

from pagedserve.quant import tinygemm  # noqa: E402

# fp16 inputs multiply exactly (integers and fp16 activations into fp32); bf16 activations carry their own rounding.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


@functools.lru_cache(maxsize=16)  # every shape of this module: GPU memory is plenty, rebuilding is slow
def weight(bits: int, k: int, n: int, group: int, act_order: bool):
    w = random_weight(k, n, bits, group, act_order, seed=k + n + bits)
    on_cuda = type(w)(*(t.cuda() for t in (w.qweight, w.qzeros, w.scales, w.g_idx)), w.bits, k, n)
    return on_cuda, w.dequantize(torch.float32).cuda()


def check(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = (got.float() - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), f"max abs err {err} vs max {want.abs().max().item()}"


@pytest.mark.parametrize("bits,k,n,group,act_order", [
    (4, 4096, 4096, 128, False),
    (4, 4096, 14336, 128, True),
    (4, 4160, 96, 128, True),     # partial last group, act-order, N under one tile
    (8, 4096, 1024, 64, True),
    (8, 1056, 72, -1, False),     # one group, N not a multiple of 64
])
@pytest.mark.parametrize("m", [1, 5, 16, 32, 63, 200])  # each launch bucket: GEMV to 16, tile kernel, 200 dense (RULE)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a16_matches_dense_reference(bits, k, n, group, act_order, m, dtype):
    w, dense = weight(bits, k, n, group, act_order)
    if dtype == torch.float16:
        dense = dense.half().float()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
    got = w4a16_kernel.W4A16Kernel(w)(x)
    assert got.dtype == dtype and got.shape == (m, n)
    check(got, x.float() @ dense.t(), TOLERANCE[dtype])


@pytest.mark.parametrize("m", [200, 2048])
def test_fused_kernel_at_prefill_sizes(m):
    """The launch table's prefill tile (the bench forces the fused kernel there; the rule runs cuBLAS)."""
    w, dense = weight(4, 4096, 4096, 128, False)
    x = torch.randn(m, 4096, generator=torch.Generator().manual_seed(m)).half().cuda()
    check(w4a16_kernel.W4A16Kernel(w)(x, force="decode"), x.float() @ dense.t(), TOLERANCE[torch.float16])


@pytest.mark.parametrize("bits,k,n,group,act_order", [
    (4, 4096, 4096, 128, False), (4, 4096, 14336, 128, True), (4, 4160, 96, 128, True), (4, 1056, 72, -1, False)])
@pytest.mark.parametrize("m", [17, 200, 512])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_pairs_gemm_at_prefill_sizes(bits, k, n, group, act_order, m, dtype):
    """The fused GEMM of quant/w4a16_fused.py (weights made in pairs inside the GEMM; the bench's w4a16_fused and
    w4a16_fused_64), both tiles: the dense reference within the tolerance (tests/test_w4a16_pairs.py also holds it to
    the dense path's result within the output's rounding, under the interpreter)."""
    import bench_w4a16
    from pagedserve.quant import w4a16_fused

    w, dense = weight(bits, k, n, group, act_order)
    if dtype == torch.float16:
        dense = dense.half().float()
    kernel = w4a16_kernel.W4A16Kernel(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
    want = x.float() @ dense.t()
    xs = x if kernel.perm is None else x.index_select(1, kernel.perm)
    for got in (kernel(x, force="fused"),
                w4a16_fused.fused_gemm(xs, kernel.layout(), w4a16_fused.FusedConfig(*bench_w4a16.FUSED_64))):
        check(got, want, TOLERANCE[dtype])


def test_w4a16_down_projection_shape():
    w, dense = weight(4, 14336, 4096, 128, True)
    x = torch.randn(1, 14336, generator=torch.Generator().manual_seed(1)).half().cuda()
    check(w4a16_kernel.W4A16Kernel(w)(x), x.float() @ dense.half().float().t(), TOLERANCE[torch.float16])


@pytest.mark.parametrize("m", [1, 16, 40])
@pytest.mark.parametrize("bits,k,n,group", [(4, 4096, 4096, 128), (8, 4096, 1024, 64), (4, 4160, 96, 128)])
def test_serial_split_k_reduction(bits, k, n, group, m):
    """The last program of each tile sums the partials (counters in global memory): the same bits as the two-kernel
    sum, over repeated calls (the counters must come back to zero)."""
    w, dense = weight(bits, k, n, group, bits == 4)
    kernel = w4a16_kernel.W4A16Kernel(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half().cuda()
    two_kernels = kernel(x, force="decode")
    for _ in range(3):
        torch.testing.assert_close(kernel(x, force="decode_serial"), two_kernels, rtol=0, atol=0)
    assert int(kernel.locks.abs().sum().item()) == 0
    check(two_kernels, x.float() @ dense.half().float().t(), TOLERANCE[torch.float16])


@pytest.mark.parametrize("group,k,n", [(128, 4096, 4096), (64, 4096, 1024), (-1, 2048, 512), (128, 4160, 96)])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_tinygemm_matches_its_emulation_and_the_reference(group, k, n, m):
    w, dense = weight(4, k, n, group, True)
    assert tinygemm.unsupported_reason(w) is None  # 4160: 64-row tinygemm groups, the partial last one's scale
    kernel = tinygemm.TinyGemmKernel(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half().cuda()
    got = kernel(x)
    assert got.dtype == torch.float16 and got.shape == (m, n)
    xs = x if kernel.perm is None else x.index_select(1, kernel.perm)
    layout = w4a16_kernel.repack(w)
    emulated = tinygemm.emulate(xs.to(torch.bfloat16), tinygemm.int4_values(layout), kernel.group,
                                kernel.scales_and_zeros)
    check(got, emulated, 1e-2)
    check(got, x.float() @ dense.t(), 2e-2)


SPLITK_SHAPES = ((4, 4096, 14336, 128, True), (4, 4160, 96, 128, True), (8, 1056, 72, -1, False),
                 (4, 14336, 4096, 128, False))


@pytest.mark.parametrize("index", range(24))
@pytest.mark.parametrize("m", [1, 16, 30])
def test_every_benched_splitk_launch_matches_reference(index, m):
    """Each split-K launch the bench times, compiled, at model sizes and odd ones (partial last group, act-order,
    8-bit, one group, N under one tile; the 32- and 64-row tiles at 30 rows), fp16 (and bf16 for the default, the
    half2 and pairs ones): the product of the dense weight."""
    import bench_w4a16
    from pagedserve.quant import w4a16_splitk

    assert len(bench_w4a16.SPLITK_SWEEP) == 24, "keep this test's range equal to the sweep's length"
    cfg = w4a16_splitk.SplitKConfig(*bench_w4a16.SPLITK_SWEEP[index])
    if (m > 16) != (cfg.block_m > 16):
        pytest.skip("16-row tiles run up to 16 rows, the wider ones are timed above")
    if m > 1 and (cfg.unpack or cfg.in_place or cfg.half2):
        pytest.skip("the same launch as another setting's above one row")
    if m == 1 and cfg.pairs:
        pytest.skip("pairs changes only the 2-16-row path")
    for shape in SPLITK_SHAPES:
        w, dense = weight(*shape)
        kernel = w4a16_kernel.W4A16Kernel(w)
        for dtype in (torch.float16, torch.bfloat16) if index == 0 or cfg.half2 or cfg.pairs else (torch.float16,):
            x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
            want = x.float() @ (dense.half().float() if dtype == torch.float16 else dense).t()
            # fp16 atomics round every span's partial sum into the fp16 output (up to 224 of them here): the H200
            # run of 2026-11-30 saw 3.2x the fp16 bound
            tol = TOLERANCE[dtype] * (5 if not w4a16_splitk.sums_last(cfg, dtype) else 1)
            for _ in range(2):  # the second call finds the workspace the first left
                check(kernel.splitk(x, cfg), want, tol)


@pytest.mark.parametrize("name", ["w4a16", "w4a16_serial", "gemv_serial", "tile", "tinygemm", "splitk_last",
                                  "splitk_atomic"])
@pytest.mark.parametrize("m", [1, 16])
def test_decode_launches_replay_under_a_cuda_graph(name, m):
    """Captured once, replayed with new activations in the same buffer: the same result as eager (no host sync, a
    fixed grid, workspaces from the graph's pool)."""
    w, _ = weight(4, 4096, 4096, 128, False)
    kernel = tinygemm.TinyGemmKernel(w) if name == "tinygemm" else w4a16_kernel.W4A16Kernel(w)
    forced = {"w4a16_serial": "decode_serial", "gemv_serial": "gemv_serial", "tile": "decode",
              "splitk_last": "splitk_last", "splitk_atomic": "splitk_atomic"}.get(name)
    if forced:
        plain = kernel
        kernel = lambda x: plain(x, force=forced)  # noqa: E731
    x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel(x)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernel(x)
    x.copy_(torch.randn(m, 4096, generator=torch.Generator().manual_seed(3)).half().cuda())
    graph.replay()
    torch.cuda.synchronize()
    if name == "splitk_atomic":  # fp16 atomics add the partial sums in an order that varies between runs
        check(y, kernel(x).float(), 1e-2)
    else:
        torch.testing.assert_close(y, kernel(x))
