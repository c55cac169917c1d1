"""A prefill-sized GPTQ/AWQ GEMM that dequantizes inside the GEMM: 4-bit codes made 16-bit weights two at a time
(w4a16_pairs.py), scaled, and fed to tl.dot tile by tile, so no dense weight is written to HBM and read back.

The rule's prefill path (`dense`: dequantize once into a transient tile, then cuBLAS) pays that round trip: at
M = 512 it reached 0.54-0.69x of dense fp16 on an H200 and the 4096 x 14336 tile alone is 117 MiB (docs/gpu.md).
The older fused tile kernel (w4a16_triton.py, 0.21-0.23x at 512) unpacks each code by shift and mask and subtracts
sum(x) z per K tile. Here, per K tile of one group:
- each word's 8 codes become four (k, k + 1) pairs of q - z, exact, by the permute / logic op / pair multiply-add of
  w4a16_pairs.py (1.6 instructions a code), and one 16-bit multiply by the group's scale makes the weight: the
  exact product rounded once, the value `dequantize_t` stores (when the scales are in the activation's dtype; fp16
  scales with bf16 activations are multiplied in fp32 and rounded once, as there);
- tl.dot accumulates in fp32 across the whole K range (one accumulator, no per-group rescaling);
- program ids are grouped along M (GROUP_M tiles share a column strip) so a strip of packed weights is read from HBM
  once and from L2 by the other row tiles.
16-bit activations and 4 bits only (`fused_takes`); activations in the layout's K order (the caller permutes
act-order's once, as for `dense`). Not in the rule until a device run measures it (bench candidate `w4a16_fused`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.quant.w4a16_layout import DecodeLayout
from pagedserve.quant.w4a16_pairs import _INTERPRETED, _pair_bits, _word_codes
from pagedserve.quant.w4a16_triton import _group_arg, block_k_for


@dataclass(frozen=True, slots=True)
class FusedConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64  # upper bound: the largest power of two dividing the group length is used
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8  # row tiles sharing one column strip of weights in L2

    def __post_init__(self) -> None:
        sizes = (self.block_m, self.block_n, self.block_k, self.num_warps)
        if not all(v > 0 and v & (v - 1) == 0 for v in sizes) or min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError(f"{self}: block_m, block_n, block_k and num_warps must be powers of two, tiles >= 16")
        if self.num_stages < 1 or self.group_m < 1:
            raise ValueError(f"{self}: num_stages and group_m must be >= 1")

    @property
    def name(self) -> str:
        return f"fused_{self.block_m}_{self.block_n}_{self.block_k}_{self.num_warps}_{self.num_stages}_{self.group_m}"


FUSED = FusedConfig()


def fused_takes(x: torch.Tensor, bits: int) -> bool:
    """16-bit activations and 4-bit codes (the pairs' magic needs a 4-bit field in a 16-bit mantissa)."""
    return x.dtype in (torch.float16, torch.bfloat16) and bits == 4


@triton.jit
def _fused_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, GROUP, stride_xm, stride_qk, stride_sg, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    SAME_DTYPE: tl.constexpr = s_ptr.dtype.element_ty == x_ptr.dtype.element_ty
    KW: tl.constexpr = BLOCK_K // 8
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * grid_n)) * GROUP_M
    rows_here = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % rows_here)
    pid_n = (pid % (GROUP_M * grid_n)) // rows_here
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    base = 128.0 if BF16 else 1024.0  # w4a16_pairs.BF16_MAGIC / FP16_MAGIC
    magic = _pair_bits(tl.full((1, 1), base, tl.float32), BF16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // GROUP
        z = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0)[None, :]
        rows = k0 // 8 + tl.arange(0, KW)
        words = tl.load(qw_ptr + rows.to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                        mask=(rows < K // 8)[:, None] & n_ok[None, :], other=0)
        codes = tl.reshape(_word_codes(words, magic, _pair_bits(-(base + z), BF16), z, BF16), (KW, BLOCK_N, 8))
        q = tl.reshape(tl.permute(codes, (0, 2, 1)), (BLOCK_K, BLOCK_N))
        if SAME_DTYPE:
            w = q * s.to(q.dtype)
        else:
            w = (q.to(tl.float32) * s.to(tl.float32)).to(q.dtype)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        if _INTERPRETED:  # the interpreter's bf16 tl.dot is wrong; the values are the same in fp32
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    tile = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fused_gemm(x: torch.Tensor, layout: DecodeLayout, cfg: FusedConfig = FUSED) -> torch.Tensor:
    """x [M, K] (fp16 or bf16, in the layout's K order) -> [M, N] in x.dtype; 4-bit layouts only."""
    if not fused_takes(x, layout.bits):
        raise ValueError(f"the fused GEMM takes fp16/bf16 activations and 4-bit codes, got {x.dtype}, "
                         f"{layout.bits} bits")
    m, n, k = x.shape[0], layout.out_features, layout.in_features
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bk = block_k_for(layout, cfg.block_k)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fused_kernel[grid](x, layout.qweight, layout.scales, layout.zeros, out, m, n, k, _group_arg(layout, bk),
                        x.stride(0), layout.qweight.stride(0), layout.scales.stride(0), out.stride(0),
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
