"""Triton dequant-GEMM for GPTQ/AWQ on CUDA: y = x @ W.T, W unpacked tile by tile in registers for few rows
(split along K to fill the GPU), dequantized once for cuBLAS for many.

Reads the canonical layout directly (qweight int32 [K/pf, N] packed along K, qzeros int32
[groups, N/pf] true zeros, scales [groups, N], g_idx int32 [K]), so act-order, group_size -1 and partial
last groups need no special case: each K row looks up its own group. Checked against the reference
under TRITON_INTERPRET=1 (tests/test_quant_triton.py); the interpreter accepts any tl.dot shape, so the
GPU constraint (K tile >= 16 for 16-bit inputs) is enforced by the static_assert below.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedserve.quant.group_quant import GroupQuantWeight, QLinearKernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# From this many rows the weight is dequantized once into a dense [N, K] tile and cuBLAS multiplies: a prompt's GEMM
# is compute-bound, and tensor-core GEMMs beat any fused dequant loop written here (the fused kernel ran at 2.3
# TFLOPS on an H100, 300x slower than fp16 cuBLAS at M = 2048: docs/gpu.md). Below it the fused kernel reads the
# packed weight once, which is what decode is bound by.
DENSE_FROM_M = 64
# Programs per SM the fused kernel aims for: at M = 1 a 4096-wide output is only 64 programs of 64 columns,
# half an H100's SMs with one program each, so the K loop is split and the partial sums added.
_PROGRAMS_PER_SM = 4


@triton.jit
def _unpack(qw_ptr, qz_ptr, s_ptr, g_ptr, offs_k, offs_n, k_ok, n_ok,
            stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn, BITS: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of W^T in fp32; each K row looks up its own group (act-order, partial groups)."""
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    kn_ok = k_ok[:, None] & n_ok[None, :]
    words = tl.load(qw_ptr + (offs_k // PF)[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=kn_ok, other=0)
    q = (words >> ((offs_k % PF) * BITS).to(tl.int32)[:, None]) & MASK
    g = tl.load(g_ptr + offs_k, mask=k_ok, other=0).to(tl.int64)
    zwords = tl.load(qz_ptr + g[:, None] * stride_zg + (offs_n // PF)[None, :] * stride_zn, mask=kn_ok, other=0)
    z = (zwords >> ((offs_n % PF) * BITS).to(tl.int32)[None, :]) & MASK
    s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=kn_ok, other=0.0)
    return (q - z).to(tl.float32) * s.to(tl.float32)


@triton.jit
def _dequant_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
    stride_ys, stride_ym, stride_yn,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_16BIT: tl.constexpr,
):
    """Program (m, n, split) adds x[m-tile, split's K range] @ W^T[same K, n-tile] into y[split] (fp32 partials
    when split, summed by the caller; the output dtype itself when there is one split)."""
    tl.static_assert(BLOCK_K >= 16)
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        k_ok = offs_k < k_end
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = _unpack(qw_ptr, qz_ptr, s_ptr, g_ptr, offs_k, offs_n, k_ok, n_ok,
                    stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn, BITS)
        if DOT_16BIT:  # fp16/bf16 tensor-core dot with fp32 accumulation
            acc += tl.dot(a, w.to(a.dtype))
        else:  # fp32, and bf16 under the interpreter (its bf16 tl.dot is wrong)
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
    tl.store(y_ptr + pid_s * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequant_kernel(
    qw_ptr, qz_ptr, s_ptr, g_ptr, w_ptr, N, K,
    stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn, stride_wn, stride_wk,
    BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """W [N, K] in w's dtype, one [BLOCK_K, BLOCK_N] tile per program."""
    offs_k = (tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k_ok = offs_k < K
    n_ok = offs_n < N
    w = _unpack(qw_ptr, qz_ptr, s_ptr, g_ptr, offs_k, offs_n, k_ok, n_ok,
                stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn, BITS)
    tl.store(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, w.to(w_ptr.dtype.element_ty),
             mask=k_ok[:, None] & n_ok[None, :])


def _weight_strides(w: GroupQuantWeight) -> tuple[int, ...]:
    return (w.qweight.stride(0), w.qweight.stride(1), w.qzeros.stride(0), w.qzeros.stride(1),
            w.scales.stride(0), w.scales.stride(1))


def dequantize(w: GroupQuantWeight, dtype: torch.dtype, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """The dense weight [N, K] in `dtype`, on the weight's device."""
    n, k = w.out_features, w.in_features
    dense = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _dequant_kernel[grid](w.qweight, w.qzeros, w.scales, w.g_idx, dense, n, k, *_weight_strides(w),
                          dense.stride(0), dense.stride(1), BITS=w.bits, BLOCK_N=block_n, BLOCK_K=block_k)
    return dense


def _splits(tiles: int, k: int, block_k: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    wanted = -(-_PROGRAMS_PER_SM * _multiprocessors(device.index or 0) // tiles)
    return max(1, min(wanted, k // (4 * block_k)))  # each split keeps at least 4 K tiles


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def dequant_gemm(x: torch.Tensor, w: GroupQuantWeight, block_m: int = 16, block_n: int = 64,
                 block_k: int = 64, splits: int | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype: the fused kernel below DENSE_FROM_M rows, dequantize + matmul from there.
    `splits` forces the number of K splits of the fused kernel (tests); None chooses from the device's SMs."""
    assert x.dim() == 2 and x.shape[1] == w.in_features, (x.shape, w.in_features)
    assert x.dtype in SUPPORTED_DTYPES, x.dtype
    assert w.qweight.dtype == torch.int32 and w.qzeros.dtype == torch.int32 and w.g_idx.dtype == torch.int32
    m, n, k = x.shape[0], w.out_features, w.in_features
    if m >= DENSE_FROM_M:
        return torch.nn.functional.linear(x, dequantize(w, x.dtype))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    splits = splits or _splits(tiles, k, block_k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    y = torch.empty(splits, m, n, dtype=torch.float32 if splits > 1 else x.dtype, device=x.device)
    dot_16bit = x.dtype == torch.float16 or (x.dtype == torch.bfloat16 and not INTERPRETED)
    _dequant_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)](
        x, w.qweight, w.qzeros, w.scales, w.g_idx, y, m, n, k, k_per_split,
        x.stride(0), x.stride(1), *_weight_strides(w), y.stride(0), y.stride(1), y.stride(2),
        BITS=w.bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_16BIT=dot_16bit,
    )
    return y[0] if splits == 1 else y.sum(dim=0).to(x.dtype)


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


# Triton builds every @triton.jit function under its interpreter when TRITON_INTERPRET=1 was set at import.
INTERPRETED = not isinstance(_dequant_gemm_kernel, triton.runtime.JITFunction)
