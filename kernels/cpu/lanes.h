/* Lane-wise comparisons, selections and fp16 conversions on the 16-lane vectors of native.h (included by it, after
 * the types).
 *
 * Why not the operators: gcc 12 lowers a 16-lane comparison (a > b on f32x16 or i32x16) to 16 scalar compares through
 * the stack when the target lacks AVX-512, so on the AVX2 tier every softmax, SiLU, bf16 and FP8 rounding, row
 * quantization and lane mask that compared vectors ran lane by lane (8% of the AVX2 decode attention over an int8
 * cache, in its peak scans alone). There each comparison is two 8-lane vcmpps / vpcmpgtd instead; elsewhere it is
 * the operator. The masks are the operators' (all bits set where true; false for NaN), so results are the same bits
 * on every tier. */
#ifndef PAGEDSERVE_CPU_LANES_H
#define PAGEDSERVE_CPU_LANES_H

#if defined(PS_AVX2_ONLY)
INLINE i32x16 cmp16_halves(f32x16 a, f32x16 b, const int predicate) {
    __m256 x[2], y[2], r[2];
    memcpy(x, &a, sizeof x), memcpy(y, &b, sizeof y);
    for (int h = 0; h < 2; h++) r[h] = _mm256_cmp_ps(x[h], y[h], predicate);
    i32x16 mask;
    memcpy(&mask, r, sizeof mask);
    return mask;
}
INLINE i32x16 gt16(f32x16 a, f32x16 b) { return cmp16_halves(a, b, _CMP_GT_OQ); }
INLINE i32x16 ge16(f32x16 a, f32x16 b) { return cmp16_halves(a, b, _CMP_GE_OQ); }
INLINE i32x16 lt16(f32x16 a, f32x16 b) { return cmp16_halves(a, b, _CMP_LT_OQ); }
INLINE i32x16 le16(f32x16 a, f32x16 b) { return cmp16_halves(a, b, _CMP_LE_OQ); }
INLINE i32x16 gt16i(i32x16 a, i32x16 b) {
    __m256i x[2], y[2], r[2];
    memcpy(x, &a, sizeof x), memcpy(y, &b, sizeof y);
    for (int h = 0; h < 2; h++) r[h] = _mm256_cmpgt_epi32(x[h], y[h]);
    i32x16 mask;
    memcpy(&mask, r, sizeof mask);
    return mask;
}
#else
INLINE i32x16 gt16(f32x16 a, f32x16 b) { return a > b; }
INLINE i32x16 ge16(f32x16 a, f32x16 b) { return a >= b; }
INLINE i32x16 lt16(f32x16 a, f32x16 b) { return a < b; }
INLINE i32x16 le16(f32x16 a, f32x16 b) { return a <= b; }
INLINE i32x16 gt16i(i32x16 a, i32x16 b) { return a > b; }
#endif

/* int32 lanes compared as signed: bit patterns below 2^31 (|x|'s, sign cleared) compare as they would unsigned. */
INLINE i32x16 lt16i(i32x16 a, i32x16 b) { return gt16i(b, a); }

/* A scalar as 16 lanes, for the comparisons above. */
INLINE f32x16 splat16(float x) { return (f32x16){0} + x; }

/* Lanes of `yes` where `mask` (a comparison's result) is set, else lanes of `no`. */
INLINE f32x16 select16(i32x16 mask, f32x16 yes, f32x16 no) {
    return (f32x16)((mask & (i32x16)yes) | (~mask & (i32x16)no));
}

/* The larger of each lane pair (b where a is NaN or not larger): select16(gt16(a, b), a, b). */
INLINE f32x16 max16(f32x16 a, f32x16 b) { return select16(gt16(a, b), a, b); }
#if defined(PS_AVX2_ONLY)
/* le16, select16 and max16 on 8 lanes (one ymm: the operators compile to one vcmpps), for the loops that take 16
 * lanes as two halves without AVX-512 */
INLINE i32x8 le8(f32x8 a, f32x8 b) { return a <= b; }
INLINE f32x8 select8(i32x8 mask, f32x8 yes, f32x8 no) { return (f32x8)((mask & (i32x8)yes) | (~mask & (i32x8)no)); }
INLINE f32x8 max8(f32x8 a, f32x8 b) { return select8(a > b, a, b); }
#endif

/* max16 over the 16-lane vectors x[0, n) (n >= 1), four running maxima at a time: one chain waited a comparison and a
 * blend per vector (~5 cycles), which made the decode softmax's and the int8 values' peak scans a few percent of
 * int8 decode attention. Lanes that are NaN in x[0] stay NaN, later NaNs are skipped, as with one chain; the maxima
 * are exact, so the order does not change them (but for which of +0 and -0 is kept, which no caller tells apart). */
INLINE f32x16 max16_scan(const float *x, int64_t n) {
#if defined(PS_AVX2_ONLY)
    /* the same comparisons in 8-lane halves: as 16-lane values the four maxima went through the stack and general
     * registers on every step of the scan */
    f32x8 m[4][2];
    memcpy(&m[0], x, sizeof m[0]);
    for (int j = 1; j < 4; j++) memcpy(&m[j], &m[0], sizeof m[j]);
    int64_t i = 1;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++) {
                f32x8 v;
                memcpy(&v, x + 16 * (i + j) + 8 * h, sizeof v);
                m[j][h] = max8(v, m[j][h]);
            }
    for (; i < n; i++)
        for (int h = 0; h < 2; h++) {
            f32x8 v;
            memcpy(&v, x + 16 * i + 8 * h, sizeof v);
            m[0][h] = max8(v, m[0][h]);
        }
    f32x8 out[2];
    for (int h = 0; h < 2; h++) out[h] = max8(max8(m[1][h], m[0][h]), max8(m[3][h], m[2][h]));
    f32x16 peak;
    memcpy(&peak, out, sizeof peak);
    return peak;
#else
    f32x16 m[4];
    memcpy(&m[0], x, sizeof m[0]);
    m[1] = m[2] = m[3] = m[0];
    int64_t i = 1;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) {
            f32x16 v;
            memcpy(&v, x + 16 * (i + j), sizeof v);
            m[j] = max16(v, m[j]);
        }
    for (; i < n; i++) {
        f32x16 v;
        memcpy(&v, x + 16 * i, sizeof v);
        m[0] = max16(v, m[0]);
    }
    return max16(max16(m[1], m[0]), max16(m[3], m[2]));
#endif
}

INLINE float hmax16(f32x16 x) {  /* the two halves lane by lane, then the 8 maxima */
    const f32x8 lo = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7),
                hi = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    float m = lo[0] > hi[0] ? lo[0] : hi[0];
    for (int i = 1; i < 8; i++) {
        const float pair = lo[i] > hi[i] ? lo[i] : hi[i];
        m = pair > m ? pair : m;
    }
    return m;
}

/* 16 fp16 lanes as fp32 and back (round to nearest even, as the C conversions): one vcvtph2ps / vcvtps2ph (two on
 * AVX2). gcc 12 converts an f16x16 vector lane by lane, a scalar vcvtsh2ss per lane with AVX512-FP16 and a vpinsrw
 * plus a scalar vcvtph2ps with AVX2: the int8 row scales of every 16 keys in decode attention, every fp16 cache
 * read and fp16 store. */
INLINE f32x16 f16x16_to_f32(f16x16 h) {
    f32x16 out;
#if defined(PS_AVX512)
    __m256i bits;
    memcpy(&bits, &h, sizeof bits);
    const __m512 wide = _mm512_cvtph_ps(bits);
    memcpy(&out, &wide, sizeof out);
#elif defined(PS_AVX2)
    __m128i bits[2];
    memcpy(bits, &h, sizeof bits);
    const __m256 wide[2] = {_mm256_cvtph_ps(bits[0]), _mm256_cvtph_ps(bits[1])};
    memcpy(&out, wide, sizeof out);
#else
    out = __builtin_convertvector(h, f32x16);
#endif
    return out;
}

INLINE f16x16 f32x16_to_f16(f32x16 x) {
    f16x16 out;
#if defined(PS_AVX512)
    __m512 v;
    memcpy(&v, &x, sizeof v);
    const __m256i bits = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    memcpy(&out, &bits, sizeof out);
#elif defined(PS_AVX2)
    __m256 v[2];
    memcpy(v, &x, sizeof v);
    const __m128i bits[2] = {_mm256_cvtps_ph(v[0], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                             _mm256_cvtps_ph(v[1], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
    memcpy(&out, bits, sizeof out);
#else
    out = __builtin_convertvector(x, f16x16);
#endif
    return out;
}

#endif
