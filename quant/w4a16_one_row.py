"""The split-K GEMV's fp32 one-row paths (w4a16_splitk.py's kernel calls them): a program's K span of one decode row
against its column tile, each 4-bit code made a float by OR-ing it into the mantissa of 2^23 (no conversion
instruction), multiplied and summed on the CUDA cores in fp32. Three ways to read the words: repeated per code (the
repeats hit L1), each word once with its codes taken field by field (`unpack`), or each field masked where it lies
(`in_place`). The 16-bit pair path is w4a16_half2.py; 2-16 rows go through tl.dot (w4a16_splitk._rows_dot).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _codes_minus_zero(words, shift, bias, BITS: tl.constexpr):
    """q - z as exact fp32 integers: the code OR-ed into the mantissa of 2^23 is 2^23 + q, and bias is 2^23 + z."""
    bits = ((words >> shift) & ((1 << BITS) - 1)) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - bias


@triton.jit
def _x_at(x_ptr, perm_ptr, k, ok, PERMUTED: tl.constexpr):
    """The activation at the weight's sorted rows k (act-order: gathered through the permutation)."""
    src = tl.load(perm_ptr + k, mask=ok, other=0) if PERMUTED else k
    return tl.load(x_ptr + src, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _one_row_repeated(x_ptr, perm_ptr, qw_ptr, bias, offs_n, n_ok, k_first, K, stride_qk, BITS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, PERMUTED: tl.constexpr):
    """One row, each word loaded once per code it holds (the repeats hit L1): a [BLOCK_K, BLOCK_N] tile per load."""
    PF: tl.constexpr = 32 // BITS
    offs_k = tl.arange(0, BLOCK_K)
    shift = ((offs_k % PF) * BITS)[:, None]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for step in tl.static_range(K_STEPS):
        k = k_first + step * BLOCK_K + offs_k
        k_ok = k < K
        words = tl.load(qw_ptr + (k // PF).to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                        mask=k_ok[:, None] & n_ok[None, :], other=0, eviction_policy="evict_first")
        x = _x_at(x_ptr, perm_ptr, k, k_ok, PERMUTED)
        acc += tl.sum(x[:, None] * _codes_minus_zero(words, shift, bias[None, :], BITS), axis=0)
    return acc


@triton.jit
def _one_row_unpacked(x_ptr, perm_ptr, qw_ptr, bias, offs_n, n_ok, k_first, K, stride_qk, BITS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, PERMUTED: tl.constexpr):
    """One row, each word loaded once and its codes taken field by field into a [words, BLOCK_N] accumulator."""
    PF: tl.constexpr = 32 // BITS
    KW: tl.constexpr = BLOCK_K // PF
    offs_w = tl.arange(0, KW)
    part = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
    for step in tl.static_range(K_STEPS):
        rows = k_first // PF + step * KW + offs_w
        w_ok = rows < K // PF
        words = tl.load(qw_ptr + rows.to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                        mask=w_ok[:, None] & n_ok[None, :], other=0, eviction_policy="evict_first")
        for f in tl.static_range(PF):
            x = _x_at(x_ptr, perm_ptr, rows * PF + f, w_ok, PERMUTED)
            part += x[:, None] * _codes_minus_zero(words, f * BITS, bias[None, :], BITS)
    return tl.sum(part, axis=0)


@triton.jit
def _one_row_in_place(x_ptr, perm_ptr, qw_ptr, offs_n, n_ok, k_first, K, stride_qk, magic, BITS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, PERMUTED: tl.constexpr):
    """One row, each word loaded once and each field masked where it lies, not shifted: OR-ed into the mantissa of
    2^23, a field at bit b reads 2^23 + q 2^b exactly, so the activation is scaled by 2^-b instead (exact, once per
    row, not per column); the fields past the mantissa come from the word shifted once. The zero point is applied
    per span, (sum x q - z sum x) s, so a code costs a mask-or, a subtract and a multiply-add (3 instructions
    against 5; `magic` is 2^23's bits in a register, MANTISSA_MAGIC). Returns (sum x q, sum x)."""
    PF: tl.constexpr = 32 // BITS
    KW: tl.constexpr = BLOCK_K // PF
    LOW: tl.constexpr = 23 // BITS  # fields wholly inside the 23-bit mantissa
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_w = tl.arange(0, KW)
    part = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
    xsum = tl.zeros((KW,), dtype=tl.float32)
    for step in tl.static_range(K_STEPS):
        rows = k_first // PF + step * KW + offs_w
        w_ok = rows < K // PF
        words = tl.load(qw_ptr + rows.to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                        mask=w_ok[:, None] & n_ok[None, :], other=0, eviction_policy="evict_first")
        high = words >> (LOW * BITS)  # its sign-filled top bits lie above every field mask used on it
        for f in tl.static_range(PF):
            x = _x_at(x_ptr, perm_ptr, rows * PF + f, w_ok, PERMUTED)
            xsum += x
            if f < LOW:
                field = (words & (MASK << (f * BITS))) | magic
                x = x * (1.0 / (1 << (f * BITS)))
            else:
                field = (high & (MASK << ((f - LOW) * BITS))) | magic
                x = x * (1.0 / (1 << ((f - LOW) * BITS)))
            part += x[:, None] * (field.to(tl.float32, bitcast=True) - 8388608.0)
    return tl.sum(part, axis=0), tl.sum(xsum, axis=0)
