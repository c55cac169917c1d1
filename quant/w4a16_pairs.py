"""2-16 decode rows of the split-K GEMV (w4a16_splitk.py) through tl.dot, with 4-bit codes made 16-bit weights two at
a time by Marlin's trick instead of one by one.

The fp32 route of `_rows_dot` takes each code out by a shift and a mask, ORs it into 2^23, subtracts, and converts
pairs to the 16-bit type: 10 sm_90 instructions a code at ROWS's launch (benchmarks/w4a16_sass.py), which makes the
16-row GEMV issue-bound long before it reads HBM at copy speed (0.61-0.71x of dense fp16 at M = 16 on an H200). Here
a word's 8 codes (K rows 8r..8r+7, code j at bits 4j..4j+3) become four 16-bit pairs in registers:
- the word and the word shifted right by 4 give, by one byte permute, an int32 whose low half holds code 2i in its
  low nibble and whose high half holds code 2i + 1 in its low nibble;
- one 3-input logic op masks both nibbles (0x000F000F) and ORs the exponent of M twice (fp16 1024.0, bf16 128.0:
  the nibble is then M + q exactly, its ulp is 1);
- one 16-bit-pair multiply-add by (1, 1) minus (M + z, M + z) leaves (q - z) exactly (|q - z| <= 15).
So 8 codes cost a shift, 4 permutes, 4 logic ops and 4 pair multiply-adds (13, 1.6 a code), and the pair is already
the (k, k + 1) pair a tensor-core operand holds, so no permute regroups it on the way into tl.dot: about 4 a code in
all with the act-order gather, 3.6 without. The weights are exact integers in fp16 and bf16, products are summed
in fp32 by the tensor cores: the same values as `_rows_dot`. fp32 activations and 8-bit codes keep `_rows_dot`.

Under TRITON_INTERPRET the PTX cannot run: the same (q - z) values are computed in Triton and go through the same
join and reshape, so the interpreter checks the code order the PTX produces.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.quant.w4a16_triton import INTERPRETED


def _pairs_ptx(bf16: bool) -> str:
    """PTX for one word: $0-$7 the codes 0-7 minus z as 16-bit floats, $8 the word, $9 M twice (the magic), $10
    -(M + z) twice. Pair i is (code 2i, code 2i + 1): bytes i of the word and of the word >> 4 (prmt's i and 4 + i)."""
    kind = "bf16x2" if bf16 else "f16x2"
    one = "0x3F803F80" if bf16 else "0x3C003C00"
    lines = ["{", ".reg .b32 h, one, t0, t1, t2, t3;", f"mov.b32 one, {one};", "shr.u32 h, $8, 4;"]
    for i in range(4):
        selector = 0x4400 + 0x1111 * i  # result bytes 0, 1 <- word byte i; bytes 2, 3 <- (word >> 4) byte i
        lines += [f"prmt.b32 t{i}, $8, h, {selector:#06x};",
                  f"lop3.b32 t{i}, t{i}, 0x000F000F, $9, 0xEA;",  # (t & mask) | magic
                  f"fma.rn.{kind} t{i}, t{i}, one, $10;",  # packed 16-bit operands take no immediates
                  f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, t{i};"]
    return "\n".join(lines + ["}"])


_PTX_F16: tl.constexpr = tl.constexpr(_pairs_ptx(False))
_PTX_BF16: tl.constexpr = tl.constexpr(_pairs_ptx(True))
_CONSTRAINTS: tl.constexpr = tl.constexpr(",".join(["=h"] * 8 + ["r"] * 3))
_INTERPRETED: tl.constexpr = tl.constexpr(INTERPRETED)
FP16_MAGIC, BF16_MAGIC = 1024.0, 128.0  # a 4-bit field in the low mantissa bits reads M + q exactly


def pairs_takes(x: torch.Tensor, bits: int) -> bool:
    """Whether a rows launch asked for pairs runs it: 16-bit activations and 4-bit codes, else `_rows_dot`."""
    return x.dtype in (torch.float16, torch.bfloat16) and bits == 4


@triton.jit
def _pair_bits(v, BF16: tl.constexpr):
    """fp32 values exact in the 16-bit type -> int32 holding the value twice (one pack-convert on a device)."""
    if _INTERPRETED:
        if BF16:
            h = v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        else:
            h = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return h | (h << 16)
    if BF16:
        return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f", [v], dtype=tl.int32,
                                         is_pure=True, pack=1)
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $1;", "=r,f", [v], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _word_codes(words, magic, neg_bias, z, BF16: tl.constexpr):
    """[KW, BLOCK_N] words -> [KW, BLOCK_N, 8] codes minus zero, K order along the last axis, in the 16-bit type."""
    if _INTERPRETED:
        c0 = (words & 15).to(tl.float32) - z
        c1 = ((words >> 4) & 15).to(tl.float32) - z
        c2 = ((words >> 8) & 15).to(tl.float32) - z
        c3 = ((words >> 12) & 15).to(tl.float32) - z
        c4 = ((words >> 16) & 15).to(tl.float32) - z
        c5 = ((words >> 20) & 15).to(tl.float32) - z
        c6 = ((words >> 24) & 15).to(tl.float32) - z
        c7 = ((words >> 28) & 15).to(tl.float32) - z
        if BF16:
            c0, c1, c2, c3 = c0.to(tl.bfloat16), c1.to(tl.bfloat16), c2.to(tl.bfloat16), c3.to(tl.bfloat16)
            c4, c5, c6, c7 = c4.to(tl.bfloat16), c5.to(tl.bfloat16), c6.to(tl.bfloat16), c7.to(tl.bfloat16)
        else:
            c0, c1, c2, c3 = c0.to(tl.float16), c1.to(tl.float16), c2.to(tl.float16), c3.to(tl.float16)
            c4, c5, c6, c7 = c4.to(tl.float16), c5.to(tl.float16), c6.to(tl.float16), c7.to(tl.float16)
    elif BF16:
        c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
            _PTX_BF16, _CONSTRAINTS, [words, magic, neg_bias], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
            _PTX_F16, _CONSTRAINTS, [words, magic, neg_bias], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    # Each join adds a last axis; the innermost one becomes the slowest of the three: codes (0, 4), (2, 6) inside,
    # even against odd outside, so that the flattened axis runs 0..7 and each PTX pair (2i, 2i + 1) stays adjacent.
    return tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))


@triton.jit
def _rows_pairs(x_ptr, perm_ptr, qw_ptr, z, offs_n, n_ok, k_first, M, K, stride_xm, stride_qk,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
                PERMUTED: tl.constexpr):
    """sum over the span of x (q - z) for up to BLOCK_M rows (fp32 [BLOCK_M, BLOCK_N]); `z` the zero points (fp32
    integers), x fp16 or bf16, 4-bit codes."""
    BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    KW: tl.constexpr = BLOCK_K // 8
    base = 128.0 if BF16 else 1024.0  # FP16_MAGIC / BF16_MAGIC
    magic = _pair_bits(tl.full((1, 1), base, tl.float32), BF16)
    z2 = z[None, :]
    neg_bias = _pair_bits(-(base + z2), BF16)
    offs_w = tl.arange(0, KW)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in tl.static_range(K_STEPS):
        rows = k_first // 8 + step * KW + offs_w
        words = tl.load(qw_ptr + rows.to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                        mask=(rows < K // 8)[:, None] & n_ok[None, :], other=0, eviction_policy="evict_first")
        codes = tl.reshape(_word_codes(words, magic, neg_bias, z2, BF16), (KW, BLOCK_N, 8))
        w = tl.reshape(tl.permute(codes, (0, 2, 1)), (BLOCK_K, BLOCK_N))
        k = k_first + step * BLOCK_K + offs_k
        k_ok = k < K
        src = tl.load(perm_ptr + k, mask=k_ok, other=0) if PERMUTED else k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + src[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if _INTERPRETED:  # the interpreter's bf16 tl.dot is wrong; the values are the same in fp32
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    return acc
