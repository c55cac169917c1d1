/* fp32 -> FP8 (e4m3fn, e5m2) on 16 lanes at once, rounding to nearest even as torch's cast does: the FP8 KV write
 * (kv_write.c), and the one the C decode step can share.
 *
 * Why: the scalar rounding (a branch, a rint and field arithmetic per value) made an FP8 cache's write of a
 * 2,048-token prefill chunk 3.5x an int8 cache's (whose rows were already quantized 16 lanes at a time): ~1.4 ms a
 * layer, ~40 ms a chunk over 30 layers, most of an FP8 prefill's time above int8's. The same integer steps on lanes
 * give the same bytes (every finite value's neighbourhood, every tie, subnormals, clamped values and NaN are tested
 * against torch's store in tests/test_native_attention.py). */
#ifndef PAGEDSERVE_CPU_KV_FP8_H
#define PAGEDSERVE_CPU_KV_FP8_H

#include "native.h"

/* 16 values (|x| past the format's largest finite value clamped here) -> 16 FP8 bytes at dst. Normals: fp32's
 * mantissa rounded to `mant` bits by adding half an FP8 step less one plus the kept bit (ties to even; a carry moves
 * into the exponent as it should), then the exponent rebiased. Subnormals (below 2^(1 - bias)): |x| in units of the
 * smallest subnormal, rounded to even by adding 2^23 (exact: the units are < 2^3), whose low bits are the byte.
 * NaN (which the clamp leaves) is 0x7f with its sign, as torch casts it. */
INLINE void fp8_store16(f32x16 x, int e4m3, uint8_t *dst) {
    const int mant = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, drop = 23 - mant;
    const float limit = e4m3 ? 448.0f : 57344.0f;
    x = select16(x > limit, (f32x16){0} + limit, x);
    x = select16(x < -limit, (f32x16){0} - limit, x);
    u32x16 u;
    memcpy(&u, &x, sizeof u);
    const u32x16 sign = (u >> 24) & 0x80;
    u &= 0x7fffffffu;
    const u32x16 rounded = u + ((1u << (drop - 1)) - 1) + ((u >> drop) & 1u);
    const u32x16 normal = (rounded >> drop) - ((uint32_t)(127 - bias) << mant);
    f32x16 mag;
    memcpy(&mag, &u, sizeof mag);
    const f32x16 units = mag * (e4m3 ? 0x1p9f : 0x1p16f) + 0x1p23f;
    u32x16 sub;
    memcpy(&sub, &units, sizeof sub);
    sub -= 0x4b000000u;  /* 2^23's bits */
    const u32x16 tiny = (u32x16)(u < ((uint32_t)(128 - bias) << 23)), nan = (u32x16)(u > 0x7f800000u);
    u32x16 out = (tiny & sub) | (~tiny & normal);
    out = (nan & 0x7fu) | (~nan & out);
    const u8x16 bytes = __builtin_convertvector(out | sign, u8x16);
    memcpy(dst, &bytes, sizeof bytes);
}

#endif
