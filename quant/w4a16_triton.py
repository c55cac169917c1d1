"""Triton kernels over the decode layout (w4a16_layout.py): the split-K decode GEMM for few rows, and the dequantize
for cuBLAS from many.

Decode is bound by reading the packed weight, so each program owns a [BLOCK_N] column tile and a K range and reads
every word once: a [BLOCK_K / pf, BLOCK_N] tile of int32 words (coalesced along N), unpacked by broadcast shifts into
[BLOCK_K, BLOCK_N] integers, multiplied with the activation as raw integers, and scaled once per group:
acc += (x . q - sum(x) * z) * s. A K tile never straddles a group (BLOCK_K divides the group length). A narrow N
still fills the SMs by splitting K; the fp32 partial sums go to a [splits, M, N] buffer summed by a second small
kernel (deterministic, unlike atomics), or, with the serial reduction, by the last program to finish each tile (one
launch, as Marlin does; a per-layer int32 counter per tile, reset by that program). Launch shapes come from a fixed
table keyed by the row count, and the split count from K, N and the SM count only, so a given M always launches the
same grid: CUDA graphs can capture it (no host sync, no autotune).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.quant.w4a16_layout import DecodeLayout


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    block_m: int  # 1: a multiply-and-sum per row, no tensor cores; >= 16: tl.dot
    block_n: int
    block_k: int  # upper bound; the group length may force a smaller power of two
    num_warps: int
    programs_per_sm: int  # split K until the grid has about this many programs per SM

    def __post_init__(self) -> None:
        pow2 = all(v > 0 and v & (v - 1) == 0 for v in (self.block_m, self.block_n, self.block_k, self.num_warps))
        if not pow2 or self.block_m in (2, 4, 8) or min(self.block_n, self.block_k) < 16 or self.programs_per_sm < 1:
            raise ValueError(f"{self} : tiles must be powers of two, block_m 1 or >= 16 (tl.dot), block_n and "
                             "block_k >= 16, programs_per_sm >= 1")


# By row count (the first bucket holding M). Unmeasured starting points, to be tuned from the device run's bench.
LAUNCH_TABLE: tuple[tuple[int, LaunchConfig], ...] = (
    (1, LaunchConfig(1, 64, 128, 4, 8)),
    (16, LaunchConfig(16, 64, 128, 4, 4)),
    (32, LaunchConfig(32, 64, 64, 4, 4)),
    (64, LaunchConfig(64, 64, 64, 4, 2)),
    # Prefill sizes run dequantize + cuBLAS by the rule; this tile is what the bench's forced fused run uses there.
    (1 << 30, LaunchConfig(128, 128, 64, 8, 1)),
)


def launch_config(m: int) -> LaunchConfig:
    return next(cfg for top, cfg in LAUNCH_TABLE if m <= top)


def block_k_for(layout: DecodeLayout, cap: int) -> int:
    """Largest power of two <= cap dividing the group length (any, with one group), at least 16."""
    if layout.group_size == layout.in_features:
        return cap
    bk = cap
    while layout.group_size % bk:
        bk //= 2
    assert bk >= 16, layout.group_size
    return bk


@triton.jit
def _decode_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, out_ptr, lock_ptr, M, N, K, K_PER_SPLIT, GROUP,
                        stride_xm, stride_qk, stride_sg, stride_ys, stride_ym,
                        BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_16BIT: tl.constexpr, SERIAL: tl.constexpr):
    PF: tl.constexpr = 32 // BITS
    BLOCK_KW: tl.constexpr = BLOCK_K // PF
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    shifts = tl.arange(0, PF) * BITS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_w = k0 // PF + tl.arange(0, BLOCK_KW)
        words = tl.load(qw_ptr + offs_w.to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                        mask=(offs_w * PF < k_end)[:, None] & n_ok[None, :], other=0)
        q3 = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [words, fields, N]: row pf*w + f
        g = k0 // GROUP
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if BLOCK_M == 1:  # a GEMV: tensor cores would idle 15 of 16 rows; K stays [words, fields], no reshape
            offs_k3 = k0 + tl.arange(0, BLOCK_KW)[:, None] * PF + tl.arange(0, PF)[None, :]
            x3 = tl.load(x_ptr + pid_m.to(tl.int64) * stride_xm + offs_k3, mask=offs_k3 < k_end,
                         other=0.0).to(tl.float32)
            part = tl.sum(tl.sum(x3[:, :, None] * q3.to(tl.float32), axis=1), axis=0)
            xsum = tl.sum(tl.sum(x3, axis=1), axis=0)
            acc += ((part - xsum * z) * s)[None, :]
        else:
            q = tl.reshape(q3, (BLOCK_K, BLOCK_N))
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & (offs_k < k_end)[None, :], other=0.0)
            if DOT_16BIT:  # integers <= 255 are exact in fp16 and bf16; fp32 accumulation
                part = tl.dot(x, q.to(x.dtype))
            else:  # fp32, and bf16 under the interpreter (its bf16 tl.dot is wrong)
                part = tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
            xsum = tl.sum(x.to(tl.float32), axis=1)
            acc += (part - xsum[:, None] * z[None, :]) * s[None, :]
    tile_ok = m_ok[:, None] & n_ok[None, :]
    tile = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptr + pid_s * stride_ys + tile, acc.to(y_ptr.dtype.element_ty), mask=tile_ok)
    if SERIAL:
        serial_sum(y_ptr, out_ptr, lock_ptr + pid_m * tl.num_programs(1) + pid_n, tile, tile_ok, stride_ys,
                   tl.num_programs(2), BLOCK_M, BLOCK_N)


@triton.jit
def serial_sum(y_ptr, out_ptr, lock, tile, tile_ok, stride_ys, splits, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The last of `splits` programs to arrive at this output tile sums every split's fp32 partial, in split order,
    into `out_ptr`, and leaves the tile's counter zero for the next call (and a CUDA graph's replay)."""
    tl.debug_barrier()  # every thread's partial stored before the (release) atomic below
    arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
    if arrived == splits - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for split in range(0, splits):
            total += tl.load(y_ptr + split * stride_ys + tile, mask=tile_ok, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + tile, total.to(out_ptr.dtype.element_ty), mask=tile_ok)
        tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sum_splits_kernel(p_ptr, y_ptr, SPLITS, SIZE, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < SIZE
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(p_ptr + s * SIZE + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, GROUP, stride_qk, stride_sg, stride_wk,
                    BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W.T [K, N] (sorted K order) in w's dtype, one [BLOCK_K, BLOCK_N] tile per program: N contiguous on both
    sides, so loads and stores stream without a transpose."""
    PF: tl.constexpr = 32 // BITS
    k0 = tl.program_id(0) * BLOCK_K
    offs_w = k0 // PF + tl.arange(0, BLOCK_K // PF)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    words = tl.load(qw_ptr + offs_w.to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                    mask=(offs_w * PF < K)[:, None] & n_ok[None, :], other=0)
    q = tl.reshape((words[:, None, :] >> (tl.arange(0, PF) * BITS)[None, :, None]) & ((1 << BITS) - 1),
                   (BLOCK_K, BLOCK_N))
    g = k0 // GROUP
    s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    w = (q.to(tl.float32) - z[None, :]) * s[None, :]
    tl.store(w_ptr + offs_k.to(tl.int64)[:, None] * stride_wk + offs_n[None, :], w.to(w_ptr.dtype.element_ty),
             mask=(offs_k < K)[:, None] & n_ok[None, :])


def _group_arg(layout: DecodeLayout, block_k: int) -> int:
    """The group length the kernels divide by; one group gets a length no K tile reaches."""
    return layout.group_size if layout.group_size < layout.in_features else triton.cdiv(layout.in_features,
                                                                                        block_k) * block_k


def dequantize_t(layout: DecodeLayout, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight transposed, [K (sorted order), N], in `dtype` (x @ it is the layer's output)."""
    dense = torch.empty(layout.in_features, layout.out_features, dtype=dtype, device=layout.qweight.device)
    return dequantize_t_into(layout, 0, dense)


def dequantize_t_into(layout: DecodeLayout, n0: int, dense: torch.Tensor) -> torch.Tensor:
    """Columns [n0, n0 + dense.shape[1]) of the dense weight transposed into `dense` ([K, width], unit column
    stride: a column slice of a wider buffer will do)."""
    k, n = layout.in_features, dense.shape[1]
    bk, bn = block_k_for(layout, 64), 64
    cols = slice(n0, n0 + n)
    _dequant_kernel[(triton.cdiv(k, bk), triton.cdiv(n, bn))](
        layout.qweight[:, cols], layout.scales[:, cols], layout.zeros[:, cols], dense, n, k, _group_arg(layout, bk),
        layout.qweight.stride(0), layout.scales.stride(0), dense.stride(0), BITS=layout.bits, BLOCK_N=bn, BLOCK_K=bk)
    return dense


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_count(cfg: LaunchConfig, tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """K splits for `tiles` output tiles: enough programs to fill the SMs, each split keeping >= 4 K tiles."""
    if device.type != "cuda":
        return 1
    wanted = -(-cfg.programs_per_sm * _multiprocessors(device.index or 0) // tiles)
    return max(1, min(wanted, k // (4 * block_k)))


def decode_gemm(x: torch.Tensor, layout: DecodeLayout, splits: int | None = None,
                locks: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (already in the layout's K order) -> [M, N] in x.dtype through the split-K decode kernel.
    `splits` forces the K split count (tests); None derives it from the device. `locks` (int32, zeros, one per
    output tile, kept by the caller across calls: the kernel leaves them zero) selects the serial reduction: the
    last split of each tile adds the partials, no second kernel; without enough locks the sum kernel runs."""
    m, n, k = x.shape[0], layout.out_features, layout.in_features
    cfg = launch_config(m)
    bk = block_k_for(layout, cfg.block_k)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    splits = splits or split_count(cfg, tiles, k, bk, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    partial = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    serial = splits > 1 and locks is not None and locks.numel() >= tiles
    dot_16bit = x.dtype == torch.float16 or (x.dtype == torch.bfloat16 and not INTERPRETED)
    _decode_gemm_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)](
        x, layout.qweight, layout.scales, layout.zeros, partial, out, locks if serial else out, m, n, k, k_per_split,
        _group_arg(layout, bk), x.stride(0), layout.qweight.stride(0), layout.scales.stride(0),
        partial.stride(0) if splits > 1 else 0, n, BITS=layout.bits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=bk, DOT_16BIT=dot_16bit, SERIAL=serial, num_warps=cfg.num_warps)
    if splits > 1 and not serial:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](partial, out, splits, m * n, BLOCK=block)
    return out


# Triton builds every @triton.jit function under its interpreter when TRITON_INTERPRET=1 was set at import.
INTERPRETED = not isinstance(_decode_gemm_kernel, triton.runtime.JITFunction)
