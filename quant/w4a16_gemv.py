"""The few-row GEMV over the decode layout (w4a16_layout.py): what a decode step of a GPTQ/AWQ model runs per linear.

The first device run of the tile-GEMM decode kernel (w4a16_triton.py) read packed weights at 4-5% of copy bandwidth:
per K tile it reduced a [words, fields, N] product across threads and converted every code with an int-to-float
instruction, so arithmetic, not memory, bound it. Here:
- each program owns a [BLOCK_N] column tile and one K split, and keeps a [BLOCK_M, BLOCK_KW, BLOCK_N] fp32
  accumulator in registers for its whole K range: the only cross-thread reduction is one sum at the end;
- a code becomes a float without a conversion instruction: OR-ing it into the mantissa of 2^23 gives the float
  2^23 + q exactly, and one subtraction leaves q (a shift, one AND/OR, one FADD and the FMA per weight);
- the group's scale and zero are applied once per word row and group (acc += (x.q - sum(x) z) s), BLOCK_K never
  straddling a group;
- act-order's permutation is a gather of the activation inside the kernel (no separate index_select launch);
- split-K partials are reduced in the same launch by the last program to reach each tile (a per-layer int32
  counter per tile that the kernel leaves zero, so a CUDA graph replays it), or by a second small kernel.
The grid depends on M, N, K and the SM count only, so CUDA graphs capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.quant.w4a16_layout import DecodeLayout
from pagedserve.quant.w4a16_rule import GEMV_MAX_ROWS as MAX_ROWS
from pagedserve.quant.w4a16_triton import _multiprocessors, _sum_splits_kernel, serial_sum

@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int = 256
    block_kw: int = 8  # packed words along K per step (x 8 codes at 4 bits)
    num_warps: int = 4
    programs_per_sm: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        pow2 = all(v > 0 and v & (v - 1) == 0 for v in (self.block_n, self.block_kw, self.num_warps))
        if not pow2 or self.block_n < 16 or self.programs_per_sm < 1 or self.num_stages < 1:
            raise ValueError(f"{self}: block_n, block_kw and num_warps must be powers of two, block_n >= 16")


DEFAULT = GemvConfig()


@triton.jit
def _gemv_kernel(x_ptr, perm_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, out_ptr, lock_ptr, M, N, K, K_PER_SPLIT, GROUP,
                 stride_xm, stride_qk, stride_sg, stride_ys, BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, PERMUTED: tl.constexpr, SERIAL: tl.constexpr):
    PF: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KW * PF
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_KW, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_w = k0 // PF + tl.arange(0, BLOCK_KW)
        w_ok = offs_w * PF < k_end
        words = tl.load(qw_ptr + offs_w.to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                        mask=w_ok[:, None] & n_ok[None, :], other=0)
        g = k0 // GROUP
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        part = tl.zeros((BLOCK_M, BLOCK_KW, BLOCK_N), dtype=tl.float32)
        xsum = tl.zeros((BLOCK_M, BLOCK_KW), dtype=tl.float32)
        for f in tl.static_range(PF):
            k = offs_w * PF + f
            if PERMUTED:
                k = tl.load(perm_ptr + k, mask=w_ok, other=0)
            xf = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & w_ok[None, :],
                         other=0.0).to(tl.float32)
            bits = ((words >> (f * BITS)) & ((1 << BITS) - 1)) | 0x4B000000
            q = bits.to(tl.float32, bitcast=True) - 8388608.0
            part += xf[:, :, None] * q[None, :, :]
            xsum += xf
        acc += (part - xsum[:, :, None] * z[None, None, :]) * s[None, None, :]
    total = tl.sum(acc, axis=1)
    tile_ok = m_ok[:, None] & n_ok[None, :]
    tile = offs_m[:, None] * N + offs_n[None, :]
    tl.store(y_ptr + pid_s * stride_ys + tile, total.to(y_ptr.dtype.element_ty), mask=tile_ok)
    if SERIAL:
        serial_sum(y_ptr, out_ptr, lock_ptr + pid_n, tile, tile_ok, stride_ys, tl.num_programs(1), BLOCK_M, BLOCK_N)


def _block_kw(layout: DecodeLayout, cap: int) -> int:
    """Largest power of two <= cap words whose codes divide the group length (any, with one group)."""
    pf = 32 // layout.bits
    if layout.group_size == layout.in_features:
        return cap
    kw = cap
    while kw > 1 and layout.group_size % (kw * pf):
        kw //= 2
    return kw


def _splits(cfg: GemvConfig, tiles: int, k: int, block_k: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 2 if k >= 4 * block_k else 1  # the interpreter still runs the split path
    wanted = -(-cfg.programs_per_sm * _multiprocessors(device.index or 0) // tiles)
    return max(1, min(wanted, k // (2 * block_k)))


def gemv(x: torch.Tensor, layout: DecodeLayout, cfg: GemvConfig = DEFAULT, locks: torch.Tensor | None = None,
         splits: int | None = None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] in the checkpoint's K order (the kernel applies `layout.perm`) -> [M, N] in x.dtype.
    `locks` (int32 zeros, >= one per column tile, kept across calls) selects the one-launch reduction."""
    m, n, k = x.shape[0], layout.out_features, layout.in_features
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows, got {m}")
    x = x.contiguous()
    block_m = triton.next_power_of_2(m)
    # The accumulator is block_m x block_kw x block_n fp32 values: fewer words per step as rows grow.
    kw = _block_kw(layout, max(1, min(cfg.block_kw, 32 // block_m)))
    block_k = kw * (32 // layout.bits)
    group = layout.group_size if layout.group_size < k else triton.cdiv(k, block_k) * block_k
    tiles = triton.cdiv(n, cfg.block_n)
    splits = splits or _splits(cfg, tiles, k, block_k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    serial = splits > 1 and locks is not None and locks.numel() >= tiles
    perm = layout.perm
    _gemv_kernel[(tiles, splits)](
        x, perm if perm is not None else x, layout.qweight, layout.scales, layout.zeros, partial, out,
        locks if serial else out, m, n, k, k_per_split, group, x.stride(0), layout.qweight.stride(0),
        layout.scales.stride(0), m * n if splits > 1 else 0, BITS=layout.bits,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_KW=kw, PERMUTED=perm is not None,
        SERIAL=serial, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1 and not serial:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](partial, out, splits, m * n, BLOCK=block)
    return out
