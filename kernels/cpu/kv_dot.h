/* Integer score dots for int8 K in decode attention (decode_attention.c): each query head rounded once per call to
 * int16 with one fp32 scale, each key row widened int8 -> int16, and q.k summed as exact int32 pair products
 * (vpdpwssd on AVX512-VNNI and AVX-VNNI, vpmaddwd + vpaddd on AVX-512 and AVX2, plain vector code otherwise).
 *
 * Why: with fp32 queries every key cost head_dim / 16 FMAs per query after widening its bytes to fp32 (two
 * conversions per 16 lanes); a pair dot does 32 lanes' products in one instruction from one widening, so the score
 * half of int8 decode attention runs about half the instructions.
 *
 * Why int16 and not int8 queries (vpdpbusd, half again): the query's rounding adds to K's own int8 rounding in every
 * score. At int16 (step max|q| / 32767) it is ~1/256 of K's step (max|k| / 127), far below the bf16 rounding the
 * model's activations already carry; int8 queries would double the error int8 K costs (kernels/cpu/act_q16.h
 * measured the same trade for weights: int8 activations lost 4-8 points of top-1 agreement, int16 none).
 *
 * Numerics: |q16| <= 32767 and |k| <= 127, so a row's int32 sum is exact up to head_dim 512; it is the same in every
 * tier whatever the split or order of its pair sums, and the float epilogue (one conversion, two multiplies) is the
 * same instructions everywhere: every tier gives the same bits. A query holding NaN or inf gets a NaN scale (NaN
 * scores, as fp32 math gives). */
#ifndef PAGEDSERVE_CPU_KV_DOT_H
#define PAGEDSERVE_CPU_KV_DOT_H

#include "native.h"

typedef int16_t i16x32 __attribute__((vector_size(64)));
typedef int8_t i8x32 __attribute__((vector_size(32)));

/* One query's 16 * chunks fp32 lanes -> int16, each 16-lane chunk c twice in q16[c] (lanes 0-15 and 16-31: one
 * copy per key of the key pairs kv_dot_widen_pair builds), and the scale s with q ~ s * q16:
 * q16 = rint(q * (32767 / max|q|)), ties to even. */
INLINE float kv_dot_quantize(const f32x16 *q, int64_t chunks, i16x32 *q16) {
    f32x16 peak = {0};
    i32x16 finite = (i32x16){0} - 1;  /* all lanes set */
    for (int64_t c = 0; c < chunks; c++) {
        const f32x16 mag = select16(lt16(q[c], (f32x16){0}), -q[c], q[c]);
        finite &= le16(mag, splat16(3.4028234663852886e38f));  /* false for inf and NaN */
        peak = max16(mag, peak);
    }
    int ok = 1;
    for (int i = 0; i < 16; i++) ok &= finite[i] != 0;
    const float amax = hmax16(peak), inv = ok && amax > 0.0f ? 32767.0f / amax : 0.0f;
    const f32x16 magic = (f32x16){0} + 12582912.0f;  /* 1.5 * 2^23: adding and subtracting it rounds to even */
    for (int64_t c = 0; c < chunks; c++) {
        const f32x16 r = (q[c] * inv + magic) - magic;
        const i16x16 a = __builtin_convertvector(__builtin_convertvector(r, i32x16), i16x16);
        /* two stores, not a 32-lane shuffle: without AVX-512 gcc moved that lane by lane through the stack */
        memcpy(&q16[c], &a, sizeof a);
        memcpy((char *)&q16[c] + sizeof a, &a, sizeof a);
    }
    return ok ? amax / 32767.0f : NAN;
}

/* Lanes [16c, 16c + 16) of two int8 key rows widened to int16, row a's in lanes 0-15 and row b's in 16-31 (zeros for
 * a NULL row): a pair dot with kv_dot_quantize's q16[c] then sums a's products in int32 lanes 0-7 and b's in 8-15,
 * the layout the first level of a 16-vector transpose-add tree makes, so kv_dot_hsum_key_pairs starts one level
 * later (half the shuffles of a tree over one key per vector; every sum exact, so the same bits). */
INLINE i16x32 kv_dot_widen_pair(const int8_t *a, const int8_t *b, int64_t c) {
#if defined(PS_AVX2)
    /* two 16-byte loads into the halves of one register: assembling the 32 bytes in memory stalled every load on
     * two narrower stores (store forwarding fails), which made the whole kernel 2x slower */
    const __m128i ka = a ? _mm_loadu_si128((const __m128i *)(a + 16 * c)) : _mm_setzero_si128();
    const __m128i kb = b ? _mm_loadu_si128((const __m128i *)(b + 16 * c)) : _mm_setzero_si128();
#if defined(PS_AVX512)
    return (i16x32)_mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(ka), kb, 1));
#else
    const __m256i lo = _mm256_cvtepi8_epi16(ka), hi = _mm256_cvtepi8_epi16(kb);
    i16x32 out;
    memcpy(&out, &lo, 32);
    memcpy((char *)&out + 32, &hi, 32);
    return out;
#endif
#else
    i8x16 ka = {0}, kb = {0};
    if (a) memcpy(&ka, a + 16 * c, 16);
    if (b) memcpy(&kb, b + 16 * c, 16);
    const i8x32 bytes = __builtin_shufflevector(ka, kb, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,
                                                18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    return __builtin_convertvector(bytes, i16x32);
#endif
}

/* Lanes [32p, 32p + 32) of an int8 row widened to int16; past the row's 16 * chunks lanes, zeros (never read). */
INLINE i16x32 kv_dot_widen(const int8_t *row, int64_t p, int64_t chunks) {
    i8x32 bytes = {0};
    memcpy(&bytes, row + 32 * p, 2 * p + 1 < chunks ? 32 : 16);
#if defined(PS_AVX512)
    const __m512i wide = _mm512_cvtepi8_epi16((__m256i)bytes);
    return (i16x32)wide;
#elif defined(PS_AVX2)
    const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128((__m256i)bytes));
    const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256((__m256i)bytes, 1));
    i16x32 out;
    memcpy(&out, &lo, 32);
    memcpy((char *)&out + 32, &hi, 32);
    return out;
#else
    return __builtin_convertvector(bytes, i16x32);
#endif
}

/* acc + the pair sums of k * q: lane j gains k[2j] q[2j] + k[2j + 1] q[2j + 1] (exact in int32). */
INLINE i32x16 kv_dot_pairs(i32x16 acc, i16x32 k, i16x32 q) {
#if defined(PS_AVX512_VNNI)
    return (i32x16)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)k, (__m512i)q);
#elif defined(PS_AVX512)
    return (i32x16)_mm512_add_epi32((__m512i)acc, _mm512_madd_epi16((__m512i)k, (__m512i)q));
#elif defined(PS_AVX2)
    __m256i a[2], kk[2], qq[2];
    memcpy(a, &acc, 64), memcpy(kk, &k, 64), memcpy(qq, &q, 64);
    for (int h = 0; h < 2; h++) a[h] = ps_dpwssd8(a[h], kk[h], qq[h]);
    memcpy(&acc, a, 64);
    return acc;
#else
    const i16x16 ke = __builtin_shufflevector(k, k, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const i16x16 ko = __builtin_shufflevector(k, k, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const i16x16 qe = __builtin_shufflevector(q, q, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const i16x16 qo = __builtin_shufflevector(q, q, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return acc + __builtin_convertvector(ke, i32x16) * __builtin_convertvector(qe, i32x16) +
           __builtin_convertvector(ko, i32x16) * __builtin_convertvector(qo, i32x16);
#endif
}

#if defined(PS_AVX2_ONLY)
/* Lane j = the sum of r[j]'s 8 lanes (int32, exact): an 8 x 8 transpose-add. */
INLINE __m256i kv_dot_hsum8x8(const __m256i *r) {
    const __m256i t0 = _mm256_hadd_epi32(r[0], r[1]), t1 = _mm256_hadd_epi32(r[2], r[3]);
    const __m256i t2 = _mm256_hadd_epi32(r[4], r[5]), t3 = _mm256_hadd_epi32(r[6], r[7]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);  /* halves: lanes 0-3, 4-7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}
#endif

/* out[2j] = the sum of c[j]'s lanes 0-7 and out[2j + 1] of its lanes 8-15, for 8 vectors (16 keys' int32 dots from
 * kv_dot_widen_pair's key pairs): decode_scores.h's hsum16x16 from its second level on (exact, so any tree gives the
 * same sums). */
INLINE i32x16 kv_dot_hsum_key_pairs(const i32x16 *c) {
#if defined(PS_AVX2_ONLY)
    /* Without AVX-512 gcc built the 16-lane shuffles below from single lanes (a vmovd and a vpinsrd each, ~1,000
     * instructions a call): one 8 x 8 transpose-add per 8 keys instead, each key's 8 partials in one ymm. */
    __m256i k[16], out[2];
    memcpy(k, c, sizeof k);
    for (int h = 0; h < 2; h++) out[h] = kv_dot_hsum8x8(k + 8 * h);
    i32x16 sums;
    memcpy(&sums, out, sizeof sums);
    return sums;
#else
    i32x16 d[4], e[2];
    for (int j = 0; j < 4; j++)
        d[j] = __builtin_shufflevector(c[2 * j], c[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(c[2 * j], c[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)
        e[j] = __builtin_shufflevector(d[2 * j], d[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(d[2 * j], d[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#endif
}

#if defined(PS_AVX2)  /* F16C */
/* Bytes [16c, 16c + 16) of an FP8 row as the fp16 bits kv_row16 converts. */
INLINE __m256i kv_fp8_half_bits(const void *row, int64_t c, int dt) {
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((const int8_t *)row + 16 * c)));
    return dt == DT_E4M3 ? _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16((short)0xBF80))
                         : _mm256_slli_epi16(w, 8);
}
#endif

/* 16 lanes of a decode K or V row as fp32 (load16 but for FP8). FP8 goes through fp16 bits: the byte sign-extended
 * to 16 bits and shifted puts e5m2 in fp16's top byte (its value) and e4m3's exponent and mantissa in fp16's low
 * exponent bits (2^-8 times its value; the callers fold 2^8 into the query factor and the V factor), and one
 * vcvtph2ps widens 16 lanes exactly, subnormals included (every byte value is tested). load16 moved the bits into
 * fp32's fields and multiplied by 2^120: twice the instructions per 16 lanes, which made FP8 decode attention 1.3x
 * bf16's with the data in cache. Results are the bits load16's gave: the powers of two cancel exactly. */
INLINE f32x16 kv_row16(const void *row, int64_t c, int dt) {
    if (dt != DT_E4M3 && dt != DT_E5M2) return load16(row, c, dt);
#if defined(PS_AVX2)
    const __m256i half = kv_fp8_half_bits(row, c, dt);
    f16x16 h;
    memcpy(&h, &half, sizeof h);
    return f16x16_to_f32(h);
#else
    return load16(row, c, dt) * (dt == DT_E4M3 ? 0x1p-8f : 1.0f);
#endif
}

#if defined(PS_AVX2_ONLY)
/* kv_row16's 16 lanes as two ymm halves (out[0]: lanes 0-7), computed in them: returned as a 16-lane value, the
 * halves went through the stack, each 64-byte load waiting on two 32-byte stores (store forwarding fails), which made
 * the AVX2 build's decode attention over a bf16 cache spend a third of its time widening keys. The same values. */
INLINE void kv_row16_halves(const void *row, int64_t c, int dt, __m256 *out) {
    if (dt == DT_BF16) {
        for (int h = 0; h < 2; h++) {
            const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)row + 2 * c + h));
            out[h] = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
        }
    } else if (dt == DT_F16) {
        for (int h = 0; h < 2; h++) out[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)row + 2 * c + h));
    } else if (dt == DT_F32) {
        for (int h = 0; h < 2; h++) out[h] = _mm256_loadu_ps((const float *)row + 16 * c + 8 * h);
    } else {  /* DT_E4M3, DT_E5M2: int8 rows never come here (their scores and values are integer pair dots) */
        const __m256i half = kv_fp8_half_bits(row, c, dt);
        out[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
        out[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
    }
}
#endif

/* Lanes [32p, 32p + 32) of an FP8 row as two kv_row16 results: with AVX-512 one 32-lane sign extension, shift and
 * mask for both halves (then two conversions), where two kv_row16 calls take two of each. */
INLINE void kv_row32(const void *row, int64_t p, int dt, f32x16 *lo, f32x16 *hi) {
#if defined(PS_AVX512)
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((const int8_t *)row + 32 * p)));
    const __m512i half = dt == DT_E4M3 ? _mm512_and_si512(_mm512_slli_epi16(w, 7), _mm512_set1_epi16((short)0xBF80))
                                       : _mm512_slli_epi16(w, 8);
    *lo = (f32x16)_mm512_cvtph_ps(_mm512_castsi512_si256(half));
    *hi = (f32x16)_mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
#else
    *lo = kv_row16(row, 2 * p, dt);
    *hi = kv_row16(row, 2 * p + 1, dt);
#endif
}

/* A whole row of `chunks` 16-lane vectors widened to fp32 (kv_row16's values), FP8 rows two vectors at a time. */
INLINE void kv_widen_row(const void *row, int64_t chunks, int dt, f32x16 *out) {
    if ((dt == DT_E4M3 || dt == DT_E5M2) && chunks % 2 == 0)
        for (int64_t c = 0; c < chunks; c += 2) kv_row32(row, c / 2, dt, &out[c], &out[c + 1]);
    else
        for (int64_t c = 0; c < chunks; c++) out[c] = kv_row16(row, c, dt);
}

/* The power of two kv_row16 takes out of an FP8 row's values. */
INLINE float kv_row16_factor(int dt) { return dt == DT_E4M3 ? 256.0f : 1.0f; }

#endif
