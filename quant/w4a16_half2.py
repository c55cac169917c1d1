"""One decode row of the split-K GEMV (w4a16_splitk.py), 4-bit codes and 16-bit activations, two codes an
instruction: the fp16-pair dequantization of Marlin, on the CUDA cores. bf16 activations are converted to fp16 once
per row (exact from 2^-14 to 65504 in magnitude; smaller ones keep fp16's subnormal steps of 2^-24).

A word holds the 8 codes of K rows 8r..8r+7. Masking it with 0x000F000F and OR-ing two fp16 1024.0s (0x64006400, one
3-input logic instruction) gives the fp16 pair (1024 + q0, 1024 + q4); the mask 0x00F000F0 gives (1024 + 16 q1,
1024 + 16 q5); the word shifted right by 8 gives codes 2, 6 and 3, 7 the same way. One fp16x2 multiply-add per pair
turns them into (q - z) / 16: (1024 + q) / 16 - (64 + z / 16) and (1024 + 16 q) / 256 - (4 + z / 16), every step
exact in fp16 (the operands are multiples of the ulp of their binade, the result is representable). One more
multiplies the pair by the activation pair (x[8r+i], x[8r+4+i]) and adds it to an fp16x2 sum. So 8 codes cost 4 logic
ops, a shift and 8 fp16x2 multiply-adds (13 instructions, 1.6 a code); widening a two-word sum to fp32 and adding
it costs 4 more per 16 codes. The rest (loads, addresses, activation pairs, the span's reduction and its atomics)
brings the count to 2.7-3.5 a code (benchmarks/w4a16_sass.py).

Rounding, against the fp32 path's exact products and fp32 sums: each product x (q - z) / 16 is rounded to fp16 (the
HFMA2 rounds product and sum once; the activation is fp16, so the exact product has 15 significant bits), and the
fp16 sum of a word pair's 8 codes per half is rounded at every step: at most 8 roundings of 2^-11 relative of the
running sum, i.e. an error <= 8 * 2^-11 * sum |x (q - z)| per half, then the two halves are widened to fp32 and
summed in fp32 like the other paths. The 1/16 keeps the fp16 sums finite while the activation stays below
65504 / 8 ~ 8190 in magnitude (|q - z| / 16 < 1; 8 products a half); it costs precision only where a product falls
below fp16's normal range (|x (q - z)| < 2^-10): at most 2^-21 absolute per product. The sum is scaled back by 16
(exact) with the group's scale. A 16-row span (a 48-row group) has one word per fp16 sum.

Under TRITON_INTERPRET the PTX cannot run: the same arithmetic is emulated in fp32 and rounded to fp16 after every
multiply-add (exact products, so this differs from the HFMA2's single rounding only where the fp32 sum itself rounds,
which needs operands more than 2^8 apart, and then only at a rounding tie).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.quant.w4a16_triton import INTERPRETED

# Two fp16 1024.0s: a 4-bit field OR-ed into either half's low mantissa bits reads 1024 + q (1024 + 16 q at bits 4-7).
FP16_PAIR_MAGIC = 0x64006400


def half2_takes(x: torch.Tensor, bits: int) -> bool:
    """Whether a one-row launch asked for half2 runs it: 16-bit activations, 4-bit codes, and the activation 4-byte
    aligned (its pairs are read as int32s; a row viewed 2 bytes into its storage would fault), else the fp32 path."""
    return x.dtype in (torch.float16, torch.bfloat16) and bits == 4 and x.data_ptr() % 4 == 0


def _word_ptx(words: int) -> str:
    """PTX summing `words` words (one column, consecutive K) into one fp32: operands $0 the sum, $1.. the words,
    then 4 activation pairs per word, the low and high biases (-(64 + z/16), -(4 + z/16) twice) and the magic."""
    bl, bh, magic = 1 + 5 * words, 2 + 5 * words, 3 + 5 * words
    lines = ["{", ".reg .b32 t, d, acc, u, c16, c256;", ".reg .f16 lo, hi;", ".reg .f32 flo, fhi;",
             "mov.b32 c16, 0x2C002C00;", "mov.b32 c256, 0x1C001C00;"]
    first = True
    for i in range(words):
        w, x = f"${1 + i}", [f"${1 + words + 4 * i + j}" for j in range(4)]
        for half, src in ((0, w), (1, "u")):
            if half:
                lines.append(f"shr.u32 u, {w}, 8;")
            for field, (mask, scale, bias) in enumerate((("0x000F000F", "c16", bl), ("0x00F000F0", "c256", bh))):
                lines.append(f"lop3.b32 t, {src}, {mask}, ${magic}, 0xEA;")  # (src & mask) | magic
                lines.append(f"fma.rn.f16x2 d, t, {scale}, ${bias};")
                xp = x[2 * half + field]
                lines.append(f"mul.rn.f16x2 acc, d, {xp};" if first else f"fma.rn.f16x2 acc, d, {xp}, acc;")
                first = False
    lines += ["mov.b32 {lo, hi}, acc;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;", "add.f32 $0, flo, fhi;", "}"]
    return "\n".join(lines)


_PTX_ONE: tl.constexpr = tl.constexpr(_word_ptx(1))
_PTX_TWO: tl.constexpr = tl.constexpr(_word_ptx(2))
_CONSTRAINTS_ONE: tl.constexpr = tl.constexpr("=f," + ",".join(["r"] * 8))
_CONSTRAINTS_TWO: tl.constexpr = tl.constexpr("=f," + ",".join(["r"] * 13))
_INTERPRETED: tl.constexpr = tl.constexpr(INTERPRETED)


@triton.jit
def _halves(t):
    """An int32 holding two fp16 bit patterns -> (low half, high half) as fp16."""
    lo = t.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (t >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _pack(lo, hi):
    """Two fp16 tensors -> int32 with their bit patterns as (low half, high half)."""
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _twice(v):
    """An fp32 value (exact in fp16) as the int32 holding it twice in fp16: one pack-convert instruction."""
    if _INTERPRETED:
        return _pack(v.to(tl.float16), v.to(tl.float16))
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $1;", "=r,f", [v], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _fma16(a, b, c):
    """fp16 a * b + c rounded to fp16 once the exact product is summed in fp32 (the interpreter's HFMA2)."""
    return (a.to(tl.float32) * b.to(tl.float32) + c.to(tl.float32)).to(tl.float16)


@triton.jit
def _word_emulated(w, x0, x1, x2, x3, bl, bh, magic, acc_lo, acc_hi):
    """_word_ptx's arithmetic for one word in Triton's fp16 (the interpreter)."""
    for half in tl.static_range(2):
        src = (w >> 8) if half == 1 else w
        for field in tl.static_range(2):
            if field == 0:
                t_lo, t_hi = _halves((src & 0x000F000F) | magic)
                b_lo, b_hi = _halves(bl)
                scale = 0.0625
            else:
                t_lo, t_hi = _halves((src & 0x00F000F0) | magic)
                b_lo, b_hi = _halves(bh)
                scale = 0.00390625
            if half * 2 + field == 0:
                x_lo, x_hi = _halves(x0)
            elif half * 2 + field == 1:
                x_lo, x_hi = _halves(x1)
            elif half * 2 + field == 2:
                x_lo, x_hi = _halves(x2)
            else:
                x_lo, x_hi = _halves(x3)
            acc_lo = _fma16(_fma16(t_lo, scale, b_lo), x_lo, acc_lo)
            acc_hi = _fma16(_fma16(t_hi, scale, b_hi), x_hi, acc_hi)
    return acc_lo, acc_hi


@triton.jit
def _x_pair(x_ptr, perm_ptr, k):
    """(x[perm[k]], x[perm[k + 4]]) as one int32 per row, [rows, 1] (act-order: gathered one by one). The int64
    permutation is read by its low words (indices < K < 2^31, little-endian): one register an index, not two."""
    perm32 = perm_ptr.to(tl.pointer_type(tl.int32))
    lo = tl.load(x_ptr + tl.load(perm32 + 2 * k)).to(tl.float16)  # bf16: converted (fp16 is a no-op)
    return _pack(lo, tl.load(x_ptr + tl.load(perm32 + 2 * k + 8)).to(tl.float16))[:, None]


@triton.jit
def _bf16_pair_to_fp16(p):
    """An int32 holding two bf16 bit patterns -> the same values as two fp16s (exact for 2^-14 <= |x| <= 65504)."""
    lo = (p << 16).to(tl.float32, bitcast=True).to(tl.float16)
    return _pack(lo, (p & -65536).to(tl.float32, bitcast=True).to(tl.float16))


@triton.jit
def _load_step(x_ptr, perm_ptr, qw_ptr, offs_n, n_ok, first_row, K, stride_qk, KW: tl.constexpr,
               PERMUTED: tl.constexpr):
    """One step's words [KW, BLOCK_N] and its rows' four activation pairs (int32 [KW, 1] each); rows past K read
    zero words and zero activations."""
    rows = first_row + tl.arange(0, KW)
    w_ok = rows < K // 8
    words = tl.load(qw_ptr + rows.to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                    mask=w_ok[:, None] & n_ok[None, :], other=0, eviction_policy="evict_first")
    if PERMUTED:  # gathered from rows clamped inside K, zeroed a pair at a time past it: a masked 16-bit load costs
        k = tl.minimum(rows, K // 8 - 1) * 8  # a zeroing instruction per element (8 a row, the select 4)
        ok = w_ok[:, None]
        return (words, tl.where(ok, _x_pair(x_ptr, perm_ptr, k), 0), tl.where(ok, _x_pair(x_ptr, perm_ptr, k + 1), 0),
                tl.where(ok, _x_pair(x_ptr, perm_ptr, k + 2), 0), tl.where(ok, _x_pair(x_ptr, perm_ptr, k + 3), 0))
    # In K order a row's 8 activations are 4 aligned int32s (K % 8 == 0): (x0, x1), (x2, x3), (x4, x5), (x6, x7),
    # regrouped into the pairs (x0, x4), (x1, x5), (x2, x6), (x3, x7) by byte permutes.
    x32 = x_ptr.to(tl.pointer_type(tl.int32)) + rows * 4
    a = tl.load(x32, mask=w_ok, other=0)
    b = tl.load(x32 + 1, mask=w_ok, other=0)
    c = tl.load(x32 + 2, mask=w_ok, other=0)
    d = tl.load(x32 + 3, mask=w_ok, other=0)
    if _INTERPRETED:
        p0, p1 = (a & 0xFFFF) | (c << 16), ((a >> 16) & 0xFFFF) | (c & -65536)
        p2, p3 = (b & 0xFFFF) | (d << 16), ((b >> 16) & 0xFFFF) | (d & -65536)
    else:  # one byte permute a pair (the Triton expressions above take a logic op more for half of them)
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            "prmt.b32 $0, $4, $6, 0x5410;\nprmt.b32 $1, $4, $6, 0x7632;\n"
            "prmt.b32 $2, $5, $7, 0x5410;\nprmt.b32 $3, $5, $7, 0x7632;", "=r,=r,=r,=r,r,r,r,r", [a, b, c, d],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    if x_ptr.dtype.element_ty == tl.bfloat16:
        p0, p1, p2, p3 = _bf16_pair_to_fp16(p0), _bf16_pair_to_fp16(p1), _bf16_pair_to_fp16(p2), _bf16_pair_to_fp16(p3)
    return words, p0[:, None], p1[:, None], p2[:, None], p3[:, None]


@triton.jit
def _one_row_half2(x_ptr, perm_ptr, qw_ptr, z, offs_n, n_ok, k_first, K, stride_qk, magic, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, PERMUTED: tl.constexpr):
    """sum over the span of x (q - z) for each column (fp32 [BLOCK_N]); `z` the zero points (fp32, integers),
    `magic` FP16_PAIR_MAGIC in a register. Two steps' words at a time share one fp16 sum (16 codes a column)."""
    KW: tl.constexpr = BLOCK_K // 8
    bl = _twice(-(64.0 + z * 0.0625))[None, :]
    bh = _twice(-(4.0 + z * 0.0625))[None, :]
    part = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
    for pair in tl.static_range((K_STEPS + 1) // 2):
        wa, xa0, xa1, xa2, xa3 = _load_step(x_ptr, perm_ptr, qw_ptr, offs_n, n_ok,
                                            k_first // 8 + 2 * pair * KW, K, stride_qk, KW, PERMUTED)
        if 2 * pair + 1 < K_STEPS:
            wb, xb0, xb1, xb2, xb3 = _load_step(x_ptr, perm_ptr, qw_ptr, offs_n, n_ok,
                                                k_first // 8 + (2 * pair + 1) * KW, K, stride_qk, KW, PERMUTED)
            if _INTERPRETED:
                lo, hi = _word_emulated(wa, xa0, xa1, xa2, xa3, bl, bh, magic, tl.zeros_like(part).to(tl.float16),
                                        tl.zeros_like(part).to(tl.float16))
                lo, hi = _word_emulated(wb, xb0, xb1, xb2, xb3, bl, bh, magic, lo, hi)
                part += lo.to(tl.float32) + hi.to(tl.float32)
            else:
                part += tl.inline_asm_elementwise(_PTX_TWO, _CONSTRAINTS_TWO, [wa, wb, xa0, xa1, xa2, xa3, xb0, xb1,
                                                  xb2, xb3, bl, bh, magic], dtype=tl.float32, is_pure=True, pack=1)
        else:
            if _INTERPRETED:
                lo, hi = _word_emulated(wa, xa0, xa1, xa2, xa3, bl, bh, magic, tl.zeros_like(part).to(tl.float16),
                                        tl.zeros_like(part).to(tl.float16))
                part += lo.to(tl.float32) + hi.to(tl.float32)
            else:
                part += tl.inline_asm_elementwise(_PTX_ONE, _CONSTRAINTS_ONE, [wa, xa0, xa1, xa2, xa3, bl, bh, magic],
                                                  dtype=tl.float32, is_pure=True, pack=1)
    return tl.sum(part, axis=0) * 16.0
