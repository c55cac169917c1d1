"""8-bit K/V tiles for the decode kernel loaded as 32-bit words and widened to fp16 in registers (`word_tiles`).

An 8-bit tile handed to tl.dot as bytes is staged in shared memory as bytes and read back one byte a load to build
the 16-bit MMA operand on sm_90 (Triton 3.8): its dot-operand optimization moves any elementwise conversion past
the shared-memory read (docs/gpu.md). Here the tile is loaded as [TILE_N, HEAD_DIM / 4] int32 words, each word
widened to four fp16 values, and the four [TILE_N, HEAD_DIM / 4] results joined and reshaped into the
[TILE_N, HEAD_DIM] operand: the optimizer cannot move the widening through that change of shape, so the tile reaches
shared memory already 16-bit (128-bit stores) and the MMA reads it with ldmatrix, as for an fp16 cache.

Every widening is exact (FP8 e4m3/e5m2 and int8 values are all fp16 values), so the scores and outputs are those of
the byte path. Compiled, each word is widened by a few PTX instructions; Triton's interpreter cannot run inline
assembly, so there the same words are widened with Triton's own shifts and conversions (PTX=False).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.kv_cache import KVDtype, LayerKVCache


@triton.constexpr_function
def _ptx(fmt):
    """The PTX widening one word into four fp16 values ($0..$3 from $4). FP8: two cvt.rn.f16x2.e4m3x2 / e5m2x2
    (sm_89+), one a half-word (e5m2 is also the upper byte of its fp16, but two byte permutes cost more: ptxas then
    moved their results into the store's registers, 2.96 lane-instructions a KV byte against 2.41). int8: the fp16
    bits 0x6400 | (x + 128) are 1024 + x + 128 exactly, so one subtraction of 1152 per pair (the bias flip x ^ 0x80
    on all four bytes at once), on the ALU and fp16 pipes where I2F would take the slower conversion unit."""
    body = {
        "e4m3": """.reg .b16 lo, hi; .reg .b32 a, b;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 a, lo;
            cvt.rn.f16x2.e4m3x2 b, hi;""",
        "e5m2": """.reg .b16 lo, hi; .reg .b32 a, b;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e5m2x2 a, lo;
            cvt.rn.f16x2.e5m2x2 b, hi;""",
        "int8": """.reg .b32 x, m, c, a, b;
            xor.b32 x, $4, 0x80808080;
            mov.b32 m, 0x64646464;
            mov.b32 c, 0x64806480;
            prmt.b32 a, x, m, 0x4140;
            prmt.b32 b, x, m, 0x4342;
            sub.rn.f16x2 a, a, c;
            sub.rn.f16x2 b, b, c;""",
    }[fmt]
    return "{ " + body + """
            mov.b32 {$0, $1}, a;
            mov.b32 {$2, $3}, b; }"""


@triton.jit
def _byte(w, SHIFT: tl.constexpr, FORMAT: tl.constexpr):
    """Byte SHIFT / 8 of each word as fp16, with Triton ops (the interpreter's path). e5m2 by its bits: the
    interpreter's own e5m2 conversion flushes subnormals to zero."""
    if FORMAT == "e4m3":
        h = (w >> SHIFT).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif FORMAT == "e5m2":
        h = ((w >> SHIFT) << 8).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        h = (w >> SHIFT).to(tl.int8).to(tl.float16)
    return h


@triton.jit
def widen_words(w, FORMAT: tl.constexpr, PTX: tl.constexpr):
    """int32 words [R, W] of little-endian 8-bit values -> fp16 [R, 4W] (value 4j + e is byte e of word j)."""
    if PTX:
        h0, h1, h2, h3 = tl.inline_asm_elementwise(
            _ptx(FORMAT), "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1)
    else:
        h0 = _byte(w, 0, FORMAT)
        h1 = _byte(w, 8, FORMAT)
        h2 = _byte(w, 16, FORMAT)
        h3 = _byte(w, 24, FORMAT)
    # join(join(h0, h2), join(h1, h3)) is [R, W, 2, 2] with h0, h1, h2, h3 at minor offsets 0, 1, 2, 3
    return tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), (w.shape[0], 4 * w.shape[1]))


@triton.jit
def load_words(k_cache_ptr, v_cache_ptr, rows, key_ok, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
               FORMAT: tl.constexpr, PTX: tl.constexpr):
    """K and V rows (byte offsets `rows`, 4-aligned) widened to fp16 [TILE_N, HEAD_DIM_PAD]; masked keys read 0."""
    offs_w = tl.arange(0, HEAD_DIM_PAD // 4)
    if HEAD_DIM == HEAD_DIM_PAD:  # a mask constant along the row keeps the loads 128-bit
        mask = key_ok[:, None]
    else:
        mask = key_ok[:, None] & (offs_w < HEAD_DIM // 4)[None, :]
    kw = tl.load((k_cache_ptr + rows[:, None]).to(tl.pointer_type(tl.int32)) + offs_w[None, :], mask=mask, other=0)
    vw = tl.load((v_cache_ptr + rows[:, None]).to(tl.pointer_type(tl.int32)) + offs_w[None, :], mask=mask, other=0)
    return widen_words(kw, FORMAT, PTX), widen_words(vw, FORMAT, PTX)


WORD_FORMATS = {KVDtype.FP8_E4M3: "e4m3", KVDtype.FP8_E5M2: "e5m2", KVDtype.INT8: "int8"}


def check_word_tiles(cache: LayerKVCache) -> None:
    """Word tiles take 8-bit caches whose rows start on 4-byte boundaries (head dims that are multiples of 4)."""
    if cache.dtype not in WORD_FORMATS:
        raise ValueError(f"word tiles widen 8-bit caches (fp8_e4m3, fp8_e5m2, int8), got {cache.dtype.value}")
    if cache.dtype.is_fp8 and cache.k.is_cuda and torch.cuda.get_device_capability(cache.k.device) < (8, 9):
        raise ValueError("word tiles widen FP8 with cvt.rn.f16x2.e4m3x2 / e5m2x2, which needs sm_89 or later")
    head_dim = cache.k.shape[3]
    aligned = all(t.data_ptr() % 4 == 0 and all(s % 4 == 0 for s in t.stride()[:3]) for t in (cache.k, cache.v))
    if head_dim % 4 or not aligned:
        raise ValueError(f"word tiles need 4-byte aligned rows (head_dim {head_dim}, a multiple of 4)")
