"""The Triton dequant-GEMM (the CUDA path) against the dequantize reference.

Without CUDA, conftest sets TRITON_INTERPRET=1 and the kernel runs under Triton's CPU interpreter; with
CUDA the same tests compile it for the GPU.
"""

from __future__ import annotations

import pytest
import torch

from quant_fixtures import fixture_dir, random_weight, reference_weight

triton_gemm = pytest.importorskip("pagedserve.quant.triton_gemm", reason="triton is not installed")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on(w, device):
    return type(w)(w.qweight.to(device), w.qzeros.to(device), w.scales.to(device), w.g_idx.to(device), w.bits,
                   w.in_features, w.out_features)


@pytest.mark.parametrize("bits,k,n,group,act_order", [
    (4, 256, 128, 128, True),
    (4, 192, 64, -1, False),
    (4, 320, 64, 128, False),  # partial last group
    (8, 128, 96, 32, True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_gemm_matches_reference(bits, k, n, group, act_order, dtype):
    w = random_weight(k, n, bits, group, act_order, seed=k + n)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(5))
    ref = x @ w.dequantize(torch.float32).t()
    y = triton_gemm.dequant_gemm(x.to(dtype).to(DEVICE), _on(w, DEVICE)).float().cpu()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert (y - ref).abs().max().item() <= tol * ref.abs().max().item()


@pytest.mark.parametrize("m,splits", [(3, 3), (5, 2), (triton_gemm.DENSE_FROM_M, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_gemm_split_k_and_dense_paths(m, splits, dtype):
    """K split into partial sums (ranges not a multiple of a group, a short last split), and the dequantize +
    matmul path used from DENSE_FROM_M rows, both against the reference."""
    w = random_weight(320, 72, 4, 64, True, seed=11)
    x = torch.randn(m, 320, generator=torch.Generator().manual_seed(m))
    ref = x @ w.dequantize(torch.float32).t()
    y = triton_gemm.dequant_gemm(x.to(dtype).to(DEVICE), _on(w, DEVICE), splits=splits).float().cpu()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    assert (y - ref).abs().max().item() <= tol * ref.abs().max().item()


def test_triton_dequantize_matches_reference():
    w = random_weight(200, 96, 8, 32, True, seed=3)
    dense = triton_gemm.dequantize(_on(w, DEVICE), torch.float32).cpu()
    torch.testing.assert_close(dense, w.dequantize(torch.float32), rtol=0, atol=0)


@pytest.mark.parametrize("name,prefix", [
    ("gptq_4bit_g128_actorder_sym", "model.layers.0.mlp.down_proj"),
    ("gptq_8bit_g64_actorder_asym", "model.layers.1.self_attn.k_proj"),
    ("awq_4bit_g64", "model.layers.0.self_attn.q_proj"),
])
def test_triton_gemm_on_tool_checkpoints(name, prefix):
    w = reference_weight(fixture_dir(name), prefix)
    x = torch.randn(4, w.in_features, generator=torch.Generator().manual_seed(6))
    ref = x @ w.dequantize(torch.float32).t()
    y = triton_gemm.dequant_gemm(x.to(DEVICE), _on(w, DEVICE)).cpu()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_triton_kernel_only_claims_cuda():
    w = random_weight(128, 64, 4, 64, False)
    reason = triton_gemm.TritonGemmKernel.unsupported_reason(w, torch.device("cpu"), torch.float32)
    assert reason is not None and "CUDA" in reason
