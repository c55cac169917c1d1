"""The Triton GPTQ/AWQ dequant-GEMM compiled on a GPU: model-sized and odd shapes, act-order, partial last groups.

Marked `gpu` and skipped without CUDA. tests/test_quant_triton.py (small shapes, the tool checkpoints) runs compiled
too, from test_interpreter_cases_gpu.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

triton_gemm = pytest.importorskip("pagedserve.quant.triton_gemm", reason="triton is not installed")

from quant_fixtures import random_weight  # noqa: E402

# fp16 inputs meet the weight rounded to fp16 in tl.dot; bf16 and fp32 inputs multiply in fp32 (triton_gemm.py).
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


@functools.lru_cache(maxsize=8)
def weight(bits: int, k: int, n: int, group: int, act_order: bool):
    """Packed once per shape (the m and dtype cases share it), with its dense fp32 dequantization, on the GPU."""
    w = random_weight(k, n, bits, group, act_order, seed=k + n + bits)
    return on_cuda(w), w.dequantize(torch.float32).cuda()


def on_cuda(w):
    return type(w)(*(t.cuda() for t in (w.qweight, w.qzeros, w.scales, w.g_idx)), w.bits, w.in_features,
                   w.out_features)


@pytest.mark.parametrize("bits,k,n,group,act_order", [
    (4, 4096, 4096, 128, False),   # Llama attention projection
    (4, 4096, 14336, 128, True),   # Llama-3-8B up projection, act-order
    (8, 4096, 1024, 64, True),
    (4, 4160, 96, 128, True),      # partial last group (4160 = 32.5 groups), act-order
    (8, 1056, 72, -1, False),      # one group; N not a multiple of the 64-wide tile
    (4, 576, 200, 64, False),
])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequant_gemm_matches_dense_reference(bits, k, n, group, act_order, m, dtype) -> None:
    w, dense = weight(bits, k, n, group, act_order)
    if dtype == torch.float16:
        dense = dense.half().float()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
    want = x.float() @ dense.t()  # fp32 on the GPU: torch leaves TF32 off for matmuls unless asked
    got = triton_gemm.dequant_gemm(x, w)
    assert got.dtype == dtype and got.shape == (m, n)
    err = (got.float() - want).abs().max().item()
    assert err <= TOLERANCE[dtype] * want.abs().max().item(), f"max abs err {err}"
