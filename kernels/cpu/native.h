/* Shared by pagedserve's native CPU kernels (decode_attention.c, layer_ops.c): dtype codes, exact
 * conversions between fp32 and the 16-bit / FP8 storage types, and 16-lane GCC vectors. Everything here is inline:
 * each .c file specializes it for the dtypes it is called with. */
#ifndef PAGEDSERVE_CPU_NATIVE_H
#define PAGEDSERVE_CPU_NATIVE_H

#include "isa.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_E4M3 = 3, DT_E5M2 = 4, DT_I8 = 5 };  /* DT_I8: KV storage only */

/* memcpy, not unions: gcc vectorizes loops over these. */
static inline float bf16_to_f32(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch's .to(bfloat16); NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

static inline float f16_bits_to_f32(uint16_t bits) {
    _Float16 h;
    memcpy(&h, &bits, sizeof h);
    return (float)h;
}

#define INLINE static inline __attribute__((always_inline))

static inline int64_t elem_size(int dt) {
    return dt == DT_F32 ? 4 : dt == DT_E4M3 || dt == DT_E5M2 || dt == DT_I8 ? 1 : 2;
}

/* Element i of a tensor of dtype dt, as fp32. FP8 is exact: e5m2 is fp16's top byte, and e4m3 moved into fp16's
 * fields reads 2^-8 times its value. */
INLINE float load_at(const void *base, int64_t i, int dt) {
    if (dt == DT_F32) return ((const float *)base)[i];
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)base)[i]);
    if (dt == DT_F16) return (float)((const _Float16 *)base)[i];
    if (dt == DT_I8) return (float)((const int8_t *)base)[i];  /* times its row's scale, by the caller */
    const uint16_t b = ((const uint8_t *)base)[i];
    if (dt == DT_E4M3) return f16_bits_to_f32((uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7))) * 256.0f;
    return f16_bits_to_f32((uint16_t)(b << 8));  /* DT_E5M2 */
}

/* Stores fp32 x as element i of a tensor of a compute dtype (fp32, bf16, fp16), rounding to nearest even. */
INLINE void store_at(void *base, int64_t i, int dt, float x) {
    if (dt == DT_BF16) ((uint16_t *)base)[i] = f32_to_bf16(x);
    else if (dt == DT_F16) ((_Float16 *)base)[i] = (_Float16)x;
    else ((float *)base)[i] = x;
}

/* Row `index` of a [rows, dim] tensor of dtype `dt`, as fp32: a pointer into the tensor when it is already fp32,
 * otherwise converted into `buf`. */
INLINE const float *row_f32(const void *base, int64_t index, int64_t dim, int dt, float *buf) {
    if (dt == DT_F32) return (const float *)base + index * dim;
    for (int64_t d = 0; d < dim; d++) buf[d] = load_at(base, index * dim + d, dt);
    return buf;
}

INLINE void store_row(void *base, int64_t index, int64_t dim, int dt, const float *src, float factor) {
    for (int64_t d = 0; d < dim; d++) store_at(base, index * dim + d, dt, src[d] * factor);
}

/* 16 fp32 lanes as a GCC vector: one AVX-512 register here, two or four narrower ones elsewhere; no intrinsics, so
 * the file builds for any target gcc knows. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef _Float16 f16x16 __attribute__((vector_size(32)));

#include "lanes.h"

INLINE float hsum16(f32x16 x) {  /* a tree, not a 16-long dependency chain */
    f32x8 h = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    f32x4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* Per-thread scratch, 64-byte aligned: the vector code reads it as f32x16. */
static inline float *scratch(int64_t floats) {
    return aligned_alloc(64, (size_t)((floats + 15) / 16) * 64);
}

/* Lanes [16c, 16c + 16) of a row of dtype dt, as fp32 (FP8 as in load_at). */
INLINE f32x16 load16(const void *row, int64_t c, int dt) {
    f32x16 out;
    if (dt == DT_F32) {
        memcpy(&out, (const float *)row + 16 * c, sizeof out);
    } else if (dt == DT_BF16) {
#if defined(PS_AVX512)
        /* one vpmovzxwd: gcc 12 widens a u16x16 convertvector in two 8-lane halves plus an insert */
        const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)row + c)), 16);
#else
        u16x16 bits;
        memcpy(&bits, (const uint16_t *)row + 16 * c, sizeof bits);
        const u32x16 wide = __builtin_convertvector(bits, u32x16) << 16;
#endif
        memcpy(&out, &wide, sizeof out);
    } else if (dt == DT_F16) {
        f16x16 half;
        memcpy(&half, (const _Float16 *)row + 16 * c, sizeof half);
        out = f16x16_to_f32(half);
    } else if (dt == DT_I8) {  /* the integers; the caller multiplies by the row's scale */
        i8x16 byte;
        memcpy(&byte, (const int8_t *)row + 16 * c, sizeof byte);
#if defined(PS_AVX512)
        const __m512 wide = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)&byte)));
        memcpy(&out, &wide, sizeof out);
#else
        /* Widened in two steps: gcc 12 turns a 4x widening convertvector into 16 scalar conversions (which made
         * int8 decode attention 3x bf16's). */
        out = __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(byte, i16x16), i32x16), f32x16);
#endif
    } else {
        u8x16 byte;
        memcpy(&byte, (const uint8_t *)row + 16 * c, sizeof byte);
#if defined(PS_AVX512)
        u32x16 b;
        const __m512i widened = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)&byte));
        memcpy(&b, &widened, sizeof b);
#else
        const u32x16 b = __builtin_convertvector(__builtin_convertvector(byte, u16x16), u32x16);
#endif
        /* Sign, exponent and mantissa moved into fp32's fields read 2^-120 (e4m3) or 2^-112 (e5m2) times the value,
         * subnormals included; the power-of-two multiply is exact. Not through fp16: with AVX512-FP16, gcc 12
         * converts an fp16 vector to fp32 one lane at a time (FP8 decode attention was 3.5x bf16's). */
        const u32x16 bits = ((b & 0x80) << 24) | ((b & 0x7f) << (dt == DT_E4M3 ? 20 : 21));
        memcpy(&out, &bits, sizeof out);
        out *= dt == DT_E4M3 ? 0x1p120f : 0x1p112f;
    }
    return out;
}

/* Row scales rs[0..n) of an int8 tile as fp32 lanes (lanes past n: 0); n <= 16. */
INLINE f32x16 row_scales16(const _Float16 *rs, int64_t n) {
    f32x16 out = {0};
    if (n == 16) {
        f16x16 half;
        memcpy(&half, rs, sizeof half);
        return f16x16_to_f32(half);
    }
    for (int64_t i = 0; i < n; i++) out[i] = (float)rs[i];
    return out;
}

/* 16 fp32 lanes rounded to bf16 bits as f32_to_bf16 rounds each (nearest even, NaN stays NaN). */
INLINE u16x16 bf16x16_portable(f32x16 x) {
    u32x16 u;
    memcpy(&u, &x, sizeof u);
    const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet_nan = (u >> 16) | 0x40u;
    const u32x16 nan = (u32x16)gt16i((i32x16)(u & 0x7fffffffu), (i32x16){0} + 0x7f800000);
    return __builtin_convertvector((nan & quiet_nan) | (~nan & rounded), u16x16);
}

#if defined(PS_AVX512_BF16)
/* vcvtneps2bf16 rounds the same way in one instruction but flushes denormal inputs to zero, so a vector holding
 * one (never seen in activations, but exactness is promised) takes the portable path. */
INLINE u16x16 bf16x16_bits(f32x16 x) {
    __m512 v;
    memcpy(&v, &x, sizeof v);
    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20), 0)) return bf16x16_portable(x);  /* 0x20: denormal */
    const __m256bh bits = _mm512_cvtneps_pbh(v);
    u16x16 out;
    memcpy(&out, &bits, sizeof out);
    return out;
}
#else
INLINE u16x16 bf16x16_bits(f32x16 x) { return bf16x16_portable(x); }
#endif

/* Each lane rounded to what dtype `dt` stores, as fp32 (round_to on 16 lanes; fp32 unchanged). */
INLINE f32x16 round16(f32x16 x, int dt) {
    if (dt == DT_BF16) {
#if defined(PS_AVX512)
        const u16x16 bits = bf16x16_bits(x);
        __m256i narrow;
        memcpy(&narrow, &bits, sizeof narrow);
        const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow), 16);  /* as in load16 */
#else
        const u32x16 wide = __builtin_convertvector(bf16x16_bits(x), u32x16) << 16;
#endif
        memcpy(&x, &wide, sizeof x);
    } else if (dt == DT_F16) {
        x = f16x16_to_f32(f32x16_to_f16(x));
    }
    return x;
}

/* Stores 16 fp32 lanes as lanes [16c, 16c + 16) of a row of a compute dtype, rounding as store_at does. */
INLINE void store16(void *row, int64_t c, int dt, f32x16 x) {
    if (dt == DT_BF16) {
        const u16x16 bits = bf16x16_bits(x);
        memcpy((uint16_t *)row + 16 * c, &bits, sizeof bits);
    } else if (dt == DT_F16) {
        const f16x16 half = f32x16_to_f16(x);
        memcpy((_Float16 *)row + 16 * c, &half, sizeof half);
    } else {
        memcpy((float *)row + 16 * c, &x, sizeof x);
    }
}

/* e^x for x <= 0 (softmax numerators, SiLU): Cephes' expf polynomial on x = n ln2 + r, |r| <= ln2 / 2, within
 * 2 ulp of expf; branch-free, so loops over it vectorize. Inputs below -87 flush to 0. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x <= -87.0f ? 0.0f : p * scale;
}

/* exp_nonpositive on 16 lanes at once (and on 8, below): the same polynomial; n rounds to nearest (ties to even
 * instead of up, which keeps |r| <= ln2 / 2 all the same). One body for both widths, so each lane takes the same
 * operations (and the same contractions into FMAs) at either width: the same bits. */
#define EXP_NONPOSITIVE(NAME, F, I, LE, SELECT)                                                                      \
    INLINE F NAME(F x) {                                                                                             \
        const F floor_x = (F){0} - 87.0f, magic = (F){0} + 12582912.0f; /* 1.5 * 2^23 */                            \
        const I underflow = LE(x, floor_x);                                                                          \
        x = SELECT(underflow, floor_x, x);                                                                           \
        const F n = (x * 1.44269504088896341f + magic) - magic;                                                      \
        const F r = (x - n * 0.693359375f) + n * 2.12194440e-4f;                                                     \
        F p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                                               \
        p = p * r + 8.3334519073e-3f;                                                                                \
        p = p * r + 4.1665795894e-2f;                                                                                \
        p = p * r + 1.6666665459e-1f;                                                                                \
        p = p * r + 5.0000001201e-1f;                                                                                \
        p = p * r * r + r + 1.0f;                                                                                    \
        const I bits = (__builtin_convertvector(n, I) + 127) << 23;                                                  \
        return SELECT(underflow, (F){0}, p * (F)bits);                                                               \
    }
EXP_NONPOSITIVE(exp16_nonpositive, f32x16, i32x16, le16, select16)
#if defined(PS_AVX2_ONLY)
/* Without AVX-512 a 16-lane result that leaves registers (stored, or added to a sum) went through the stack and
 * general registers; loops there take 8 lanes at a time (decode attention's softmax). */
EXP_NONPOSITIVE(exp8_nonpositive, f32x8, i32x8, le8, select8)
#endif
#undef EXP_NONPOSITIVE

/* silu(g) = g / (1 + e^-g) from e^-|g|, which never overflows (SiLU-and-mul: layer_ops.c). */
INLINE float silu(float g) {
    const float e = exp_nonpositive(-fabsf(g));
    return g * (g >= 0.0f ? 1.0f : e) / (1.0f + e);
}

INLINE f32x16 silu16(f32x16 g) {
    const f32x16 e = exp16_nonpositive((f32x16)((i32x16)g | (i32x16){0} + INT32_MIN)), one = (f32x16){0} + 1.0f;
    return g * select16(ge16(g, (f32x16){0}), one, e) / (one + e);
}

/* silu(g) rounded to bf16 for every bf16 g, indexed by g's bits (layer_ops.c fills it at load from silu16, so a
 * lookup gives round16(silu16(g)) bit for bit, at 2x silu16's rate). One entry more, so a 32-bit gather of the
 * last stays inside. */
extern uint16_t ps_silu_bf16[65536 + 2];

/* silu of 16 bf16 gates (their bits), through ps_silu_bf16, as fp32. */
INLINE f32x16 silu16_bf16(u16x16 gates) {
    f32x16 out;
#if defined(PS_AVX512)
    __m256i g;
    memcpy(&g, &gates, sizeof g);
    const __m512i idx = _mm512_cvtepu16_epi32(g);
    const __m512i bits = _mm512_slli_epi32(_mm512_i32gather_epi32(idx, (const void *)ps_silu_bf16, 2), 16);
    memcpy(&out, &bits, sizeof out);
#else
    for (int i = 0; i < 16; i++) out[i] = bf16_to_f32(ps_silu_bf16[gates[i]]);
#endif
    return out;
}

#endif
