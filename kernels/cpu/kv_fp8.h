/* fp32 -> FP8 (e4m3fn, e5m2) on 16 lanes at once, rounding to nearest even as torch's cast does: the FP8 KV write
 * (kv_write.c) and the C decode step's row store (decode_step.c), with the scalar form for a row's last lanes.
 *
 * Why: the scalar rounding (a branch, a rint and field arithmetic per value) made an FP8 cache's write of a
 * 2,048-token prefill chunk 3.5x an int8 cache's (whose rows were already quantized 16 lanes at a time): ~1.4 ms a
 * layer, ~40 ms a chunk over 30 layers, most of an FP8 prefill's time above int8's. The same integer steps on lanes
 * give the same bytes (every finite value's neighbourhood, every tie, subnormals, clamped values and NaN are tested
 * against torch's store in tests/test_native_kv_write.py). */
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
    x = select16(gt16(x, splat16(limit)), splat16(limit), x);
    x = select16(lt16(x, splat16(-limit)), splat16(-limit), x);
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
    /* u < 2^31 (the sign is off): signed lane comparisons, which lanes.h keeps vector-wide on AVX2 */
    const u32x16 tiny = (u32x16)lt16i((i32x16)u, (i32x16){0} + ((128 - bias) << 23));
    const u32x16 nan = (u32x16)gt16i((i32x16)u, (i32x16){0} + 0x7f800000);
    u32x16 out = (tiny & sub) | (~tiny & normal);
    out = (nan & 0x7fu) | (~nan & out);
    const u8x16 bytes = __builtin_convertvector(out | sign, u8x16);
    memcpy(dst, &bytes, sizeof bytes);
}

/* |x| <= the format's largest finite value (the caller clamps), rounded to nearest even as torch's fp32 -> FP8 cast
 * rounds: normals by rounding fp32's mantissa to `mant` bits, subnormals (below 2^(1 - bias)) as a multiple of their
 * step. e4m3: bias 7, 3 mantissa bits; e5m2: bias 15, 2 bits. The lanes past a multiple of 16 (fp8_store16 above is the
 * 16-lane form). */
INLINE uint8_t fp8_bits(float x, int e4m3) {
    const int mant = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7f;  /* NaN, as torch casts it to either format */
    if (u < (uint32_t)(128 - bias) << 23)  /* subnormal (or rounds up to the smallest normal: m == 2^mant) */
        return sign | (uint8_t)rintf(fabsf(x) * (e4m3 ? 0x1p9f : 0x1p16f));
    const int drop = 23 - mant;
    u += (1u << (drop - 1)) - 1 + ((u >> drop) & 1u);
    return sign | (uint8_t)((((u >> 23) - 127 + bias) << mant) | ((u >> drop) & ((1u << mant) - 1)));
}

/* One row of head_dim values of dtype src_dt divided by `scale` (IEEE division), clamped and rounded into dst: the
 * prefill write (kv_write.c) and the C decode step's row store (decode_step.c, fp32 rows). */
INLINE void fp8_row(const char *src, int src_dt, float scale, int64_t head_dim, int e4m3, uint8_t *dst) {
    const float limit = e4m3 ? 448.0f : 57344.0f;
    int64_t d = 0;
    for (; d + 16 <= head_dim; d += 16) fp8_store16(load16(src, d / 16, src_dt) / scale, e4m3, dst + d);
    for (; d < head_dim; d++) {
        const float a = load_at(src, d, src_dt) / scale;
        dst[d] = fp8_bits(a > limit ? limit : a < -limit ? -limit : a, e4m3);
    }
}

#endif
