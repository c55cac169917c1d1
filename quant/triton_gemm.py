"""Triton dequant-GEMM for GPTQ/AWQ on CUDA: y = x @ W.T with W unpacked tile by tile in registers.

Reads the canonical layout directly (qweight int32 [K/pf, N] packed along K, qzeros int32
[groups, N/pf] true zeros, scales [groups, N], g_idx int32 [K]), so act-order, group_size -1 and partial
last groups need no special case: each K row looks up its own group. Checked against the reference
under TRITON_INTERPRET=1 (tests/test_quant_triton.py); the interpreter accepts any tl.dot shape, so the
GPU constraint (K tile >= 16 for 16-bit inputs) is enforced by the static_assert below.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.quant.group_quant import GroupQuantWeight, QLinearKernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _dequant_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
    stride_ym, stride_yn,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tl.static_assert(BLOCK_K >= 16)
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        k_ok = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        kn_ok = k_ok[:, None] & n_ok[None, :]
        words = tl.load(qw_ptr + (offs_k // PF)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                        mask=kn_ok, other=0)
        q = (words >> ((offs_k % PF) * BITS).to(tl.int32)[:, None]) & MASK
        g = tl.load(g_ptr + offs_k, mask=k_ok, other=0).to(tl.int64)
        zwords = tl.load(qz_ptr + g[:, None] * stride_zg + (offs_n // PF)[None, :] * stride_zn,
                         mask=kn_ok, other=0)
        z = (zwords >> ((offs_n % PF) * BITS).to(tl.int32)[None, :]) & MASK
        s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=kn_ok, other=0.0)
        w = (q - z).to(tl.float32) * s.to(tl.float32)
        if a.dtype == tl.float16:
            acc += tl.dot(a, w.to(tl.float16))
        else:  # fp32 and bf16 (the interpreter's bf16 tl.dot is wrong, so it is never used)
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def dequant_gemm(x: torch.Tensor, w: GroupQuantWeight, block_m: int = 16, block_n: int = 64,
                 block_k: int = 32) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype."""
    assert x.dim() == 2 and x.shape[1] == w.in_features, (x.shape, w.in_features)
    assert x.dtype in SUPPORTED_DTYPES, x.dtype
    assert w.qweight.dtype == torch.int32 and w.qzeros.dtype == torch.int32 and w.g_idx.dtype == torch.int32
    m, n, k = x.shape[0], w.out_features, w.in_features
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _dequant_gemm_kernel[grid](
        x, w.qweight, w.qzeros, w.scales, w.g_idx, y, m, n, k,
        x.stride(0), x.stride(1), w.qweight.stride(0), w.qweight.stride(1), w.qzeros.stride(0),
        w.qzeros.stride(1), w.scales.stride(0), w.scales.stride(1), y.stride(0), y.stride(1),
        BITS=w.bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y


class TritonGemmKernel(QLinearKernel):
    name = "triton"

    def __init__(self, w: GroupQuantWeight):
        super().__init__()
        self.bits, self.in_features, self.out_features = w.bits, w.in_features, w.out_features
        for field in ("qweight", "qzeros", "scales", "g_idx"):
            self.register_buffer(field, getattr(w, field).contiguous())

    @classmethod
    def unsupported_reason(cls, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return f"needs a CUDA device, got {device.type}"
        if dtype not in SUPPORTED_DTYPES:
            return f"needs an activation dtype in {SUPPORTED_DTYPES}, got {dtype}"
        return None

    @classmethod
    def from_weight(cls, w: GroupQuantWeight, dtype: torch.dtype) -> "TritonGemmKernel":
        return cls(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = GroupQuantWeight(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits,
                             self.in_features, self.out_features)
        return dequant_gemm(x.contiguous(), w)
