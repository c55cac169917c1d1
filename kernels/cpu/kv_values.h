/* probs x V in decode attention (decode_attention.c): fp32 FMAs over 16-bit and FP8 V rows (chunk_values), and
 * integer pair dots over int8 V rows (values_i8): each query's probabilities over a chunk's keys (times their V rows'
 * scales) rounded to int16 with one fp32 scale, two keys' V rows interleaved as int16 pairs, and
 * sum_t p16[t] v[t][d] summed exactly in int32 (kv_dot.h's pair dot).
 *
 * Why integers for int8: in fp32 every V row cost head_dim / 16 widenings and conversions to fp32, then one FMA per
 * 16 lanes per query; the pair dot takes two keys' products per instruction from int16 lanes, about half the vector
 * instructions of the values loop, which was a third of the int8 kernel's time with the data in cache.
 *
 * Numerics: a probability times its row scale is rounded to a step of (the chunk's largest) / 32767, so the values
 * gain an error of at most 2^-16 of the largest weighted row per key, far below the bf16 rounding of the output
 * (2^-9). Exact sums: |p16| <= 32767 and |v| <= 127 over at most KEY_CHUNK (512) keys stay under 2^31. A query's
 * rounding depends only on its own probabilities, so its partial is the same bits alone or in a span, on any
 * split and in every tier. */
#ifndef PAGEDSERVE_CPU_KV_VALUES_H
#define PAGEDSERVE_CPU_KV_VALUES_H

#include "decode_chunks.h"
#include "kv_dot.h"

_Static_assert(KEY_CHUNK <= 516, "int8 values: 32767 * 127 * KEY_CHUNK must stay below 2^31");

/* probs x V for `nq` consecutive queries (qq0..) of a span over the chunk's keys: each V row is loaded once for all
 * of them (int8 rows as stored: their scales are in the probabilities, scale_probs). Every query's sums run over all
 * the chunk's keys in order, with zero probabilities outside its own range, so its partial is bit-identical to the
 * query's computed alone (x + 0 * v == x). nq and CH (16-lane chunks of a row) are constants after inlining, and the
 * arrays have constant sizes: as variable-length arrays gcc kept the accumulators in memory, a load, FMA and store
 * per 16 lanes per key. */
#define CHUNK_VALUES(CH)                                                                                             \
    do {                                                                                                             \
        f32x16 acc[4][CH];                                                                                           \
        for (int b = 0; b < nq; b++)                                                                                 \
            for (int64_t c = 0; c < CH; c++) acc[b][c] = (f32x16){0};                                                \
        for (int64_t t0 = k->k0 - k->k0 % bs; t0 < k->k1; t0 += bs) {                                                \
            const char *tile = (const char *)a->v_cache + (h * a->num_blocks + k->table[t0 / bs]) * bs * kv_row;     \
            const int64_t n = k->k1 - t0 < bs ? k->k1 - t0 : bs, tlo = t0 < k->k0 ? k->k0 - t0 : 0;                  \
            for (int64_t i = tlo; i < n; i++) {                                                                      \
                f32x16 v[CH];                                                                                        \
                kv_widen_row(tile + i * kv_row, CH, kv_dt, v);                                                       \
                for (int b = 0; b < nq; b++) {                                                                       \
                    const float pb = scores[(qq0 + b) * KEY_CHUNK + t0 + i - k->k0];                                 \
                    for (int64_t c = 0; c < CH; c++) acc[b][c] += pb * v[c];                                         \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        for (int b = 0; b < nq; b++) memcpy(part + (qq0 + b) * stride, acc[b], sizeof(float) * (size_t)dim);         \
    } while (0)

#if defined(PS_AVX2_ONLY)
#define VALUES_BY_CHUNK 1
/* CHUNK_VALUES for AVX2 without AVX-512, the same FMAs in the same order per lane: one 16-dim chunk of the rows per
 * pass over the chunk's keys, so that 4 queries' accumulators and the widened row fit AVX2's 16 ymm registers (a
 * whole row's accumulators spilled to the stack on every FMA: half the AVX2 kernel's time over a bf16 cache). Each
 * pass reads its 16 values of every row, so a row is read once. */
INLINE void chunk_values_avx2(const DecodeArgs *a, const Keys *k, int64_t h, const float *scores, float *part,
                              int64_t qq0, const int nq, const int64_t chunks, const int kv_dt) {
    const int64_t bs = a->block_size, dim = 16 * chunks, stride = partial_stride(dim);
    const size_t kv_row = (size_t)dim * elem_size(kv_dt);
    for (int64_t c = 0; c < chunks; c++) {
        __m256 acc[4][2];
        for (int b = 0; b < nq; b++) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
        for (int64_t t0 = k->k0 - k->k0 % bs; t0 < k->k1; t0 += bs) {
            const char *tile = (const char *)a->v_cache + (h * a->num_blocks + k->table[t0 / bs]) * bs * kv_row;
            const int64_t n = k->k1 - t0 < bs ? k->k1 - t0 : bs, tlo = t0 < k->k0 ? k->k0 - t0 : 0;
            for (int64_t i = tlo; i < n; i++) {
                __m256 v[2];
                kv_row16_halves(tile + i * kv_row, c, kv_dt, v);
                for (int b = 0; b < nq; b++) {
                    const __m256 pb = _mm256_set1_ps(scores[(qq0 + b) * KEY_CHUNK + t0 + i - k->k0]);
                    acc[b][0] = _mm256_fmadd_ps(pb, v[0], acc[b][0]);
                    acc[b][1] = _mm256_fmadd_ps(pb, v[1], acc[b][1]);
                }
            }
        }
        for (int b = 0; b < nq; b++) {
            float *dst = part + (qq0 + b) * stride + 16 * c;
            _mm256_storeu_ps(dst, acc[b][0]);
            _mm256_storeu_ps(dst + 8, acc[b][1]);
        }
    }
}
#else
#define VALUES_BY_CHUNK 0
#endif

INLINE void chunk_values(const DecodeArgs *a, const Keys *k, int64_t h, const float *scores, float *part,
                         int64_t qq0, const int nq, const int64_t chunks, const int kv_dt) {
#if defined(PS_AVX2_ONLY)
    chunk_values_avx2(a, k, h, scores, part, qq0, nq, chunks, kv_dt);
#else
    const int64_t bs = a->block_size, dim = 16 * chunks, stride = partial_stride(dim);
    const size_t kv_row = (size_t)dim * elem_size(kv_dt);
    if (chunks == 4) CHUNK_VALUES(4);          /* head_dim 64 */
    else if (chunks == 8) CHUNK_VALUES(8);     /* head_dim 128 */
    else CHUNK_VALUES(chunks);                 /* other multiples of 16: the runtime count */
#endif
}
#undef CHUNK_VALUES

/* One query's weighted probabilities w[0, n) (keys k0.. of a chunk) rounded in place to int16: p16[t + off] for
 * key k0 + t, off = k0 % 2 so that pairs of keys start at even positions, zeros at off - 1 and past the last
 * key to an even count. Returns the scale (w ~ scale * p16); 0 when every weight is 0. w and p16 share memory: each
 * group of floats is read before its int16s are written, which land at or below them. */
INLINE float values_quantize(float *w, int64_t n, int64_t off) {
    /* weights are >= 0 (NaN lanes count as 0) */
    float amax = n >= 16 ? hmax16(max16(max16_scan(w, n / 16), (f32x16){0})) : 0.0f;
    int64_t t = n - n % 16;
    for (; t < n; t++) amax = w[t] > amax ? w[t] : amax;
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    const f32x16 magic = (f32x16){0} + 12582912.0f;  /* 1.5 * 2^23: adding and subtracting it rounds to even */
    int16_t *p16 = (int16_t *)w;
    for (t = 0; t + 16 <= n; t += 16) {
        f32x16 v;
        memcpy(&v, w + t, sizeof v);
        const i16x16 r = __builtin_convertvector(__builtin_convertvector((v * inv + magic) - magic, i32x16), i16x16);
        memcpy(p16 + off + t, &r, sizeof r);
    }
    for (; t < n; t++) {
        const int16_t r = (int16_t)__builtin_rintf(w[t] * inv);
        memcpy(p16 + off + t, &r, sizeof r);
    }
    const int16_t zero = 0;
    if (off) memcpy(p16, &zero, sizeof zero);  /* last: it overwrites the first float */
    if ((off + n) % 2) memcpy(p16 + off + n, &zero, sizeof zero);
    return amax / 32767.0f;
}

/* Lanes of two keys' int16 rows a and b (32 dims) interleaved as pairs, the low and the high 4 dims of every 8. */
INLINE i16x32 values_pairs_lo(i16x32 a, i16x32 b) {
    return __builtin_shufflevector(a, b, 0, 32, 1, 33, 2, 34, 3, 35, 8, 40, 9, 41, 10, 42, 11, 43, 16, 48, 17, 49, 18,
                                   50, 19, 51, 24, 56, 25, 57, 26, 58, 27, 59);
}
INLINE i16x32 values_pairs_hi(i16x32 a, i16x32 b) {
    return __builtin_shufflevector(a, b, 4, 36, 5, 37, 6, 38, 7, 39, 12, 44, 13, 45, 14, 46, 15, 47, 20, 52, 21, 53,
                                   22, 54, 23, 55, 28, 60, 29, 61, 30, 62, 31, 63);
}

/* values_pairs' lanes back in dim order, times the scale: dims [32p, 32p + 16) and [32p + 16, 32p + 32). */
INLINE void values_store(float *dst, i32x16 lo, i32x16 hi, float scale, int64_t dims) {
    const f32x16 l = __builtin_convertvector(lo, f32x16) * scale, h = __builtin_convertvector(hi, f32x16) * scale;
    const f32x16 first = __builtin_shufflevector(l, h, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const f32x16 second = __builtin_shufflevector(l, h, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    memcpy(dst, &first, sizeof first);
    if (dims > 16) memcpy(dst + 16, &second, sizeof second);
}

/* The partials' values of `nq` queries (qq0..) over the chunk's keys from their int16 probabilities (p16 of query
 * qq at scores + qq * KEY_CHUNK, scale ps[qq]); PAIRS (32-dim groups of a row) is a constant after inlining. Rows go
 * two at a time from an even row of the tile; a row past the chunk's keys weighs 0 (its bytes, whatever they hold,
 * times 0: integers, no NaN), and is in the same block (block sizes are even). */
#define VALUES_I8(PAIRS)                                                                                             \
    do {                                                                                                             \
        i32x16 acc[4][2 * PAIRS];                                                                                    \
        for (int b = 0; b < nq; b++)                                                                                 \
            for (int64_t j = 0; j < 2 * PAIRS; j++) acc[b][j] = (i32x16){0};                                         \
        for (int64_t t0 = k->k0 - k->k0 % bs; t0 < k->k1; t0 += bs) {                                                \
            const int8_t *tile = (const int8_t *)a->v_cache + (h * a->num_blocks + k->table[t0 / bs]) * bs * dim;    \
            const int64_t n = k->k1 - t0 < bs ? k->k1 - t0 : bs, tlo = t0 < k->k0 ? k->k0 - t0 : 0;                  \
            for (int64_t i = tlo - tlo % 2; i < n; i += 2) {                                                         \
                i16x32 lo[PAIRS], hi[PAIRS];                                                                         \
                for (int64_t p = 0; p < PAIRS; p++) {                                                                \
                    const i16x32 r0 = kv_dot_widen(tile + i * dim, p, chunks);                                       \
                    const i16x32 r1 = kv_dot_widen(tile + (i + 1) * dim, p, chunks);                                 \
                    lo[p] = values_pairs_lo(r0, r1), hi[p] = values_pairs_hi(r0, r1);                                \
                }                                                                                                    \
                for (int b = 0; b < nq; b++) {                                                                       \
                    int32_t pair;                                                                                    \
                    memcpy(&pair, (const int16_t *)(scores + (qq0 + b) * KEY_CHUNK) + t0 + i - base, sizeof pair);   \
                    const i16x32 pp = (i16x32)((i32x16){0} + pair);                                                  \
                    for (int64_t p = 0; p < PAIRS; p++) {                                                            \
                        acc[b][2 * p] = kv_dot_pairs(acc[b][2 * p], lo[p], pp);                                      \
                        acc[b][2 * p + 1] = kv_dot_pairs(acc[b][2 * p + 1], hi[p], pp);                              \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        for (int b = 0; b < nq; b++)                                                                                 \
            for (int64_t p = 0; p < PAIRS; p++)                                                                      \
                values_store(part + (qq0 + b) * stride + 32 * p, acc[b][2 * p], acc[b][2 * p + 1], ps[qq0 + b],     \
                             dim - 32 * p);                                                                          \
    } while (0)

#if defined(PS_AVX2_ONLY)
/* VALUES_I8 for AVX2 without AVX-512, the same sums: one 16-dim chunk of the rows per pass over the chunk's keys,
 * in ymm registers. 16 registers hold 4 queries' accumulators of one chunk beside the two widened rows; the 32-lane
 * code kept the accumulators of a whole row, which gcc spilled (and split its 32-lane interleave into a 16-bit move
 * per lane through the stack): the whole int8 kernel took 2.0x this time (1 thread, 2 rows, 3,600 keys). Each
 * pass reads its 16 bytes of every row, so a row is read once. */
INLINE void values_i8_avx2(const DecodeArgs *a, const Keys *k, int64_t h, const float *scores, const float *ps,
                           float *part, int64_t qq0, const int nq, const int64_t chunks) {
    const int64_t bs = a->block_size, dim = 16 * chunks, stride = partial_stride(dim), base = k->k0 - k->k0 % 2;
    for (int64_t c = 0; c < chunks; c++) {
        __m256i lo_acc[4], hi_acc[4];
        for (int b = 0; b < nq; b++) lo_acc[b] = hi_acc[b] = _mm256_setzero_si256();
        for (int64_t t0 = k->k0 - k->k0 % bs; t0 < k->k1; t0 += bs) {
            const int8_t *tile = (const int8_t *)a->v_cache + (h * a->num_blocks + k->table[t0 / bs]) * bs * dim;
            const int64_t n = k->k1 - t0 < bs ? k->k1 - t0 : bs, tlo = t0 < k->k0 ? k->k0 - t0 : 0;
            for (int64_t i = tlo - tlo % 2; i < n; i += 2) {
                const __m256i r0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(tile + i * dim + 16 * c)));
                const __m256i r1 = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(tile + (i + 1) * dim + 16 * c)));
                const __m256i lo = _mm256_unpacklo_epi16(r0, r1), hi = _mm256_unpackhi_epi16(r0, r1);
                for (int b = 0; b < nq; b++) {
                    int32_t pair;
                    memcpy(&pair, (const int16_t *)(scores + (qq0 + b) * KEY_CHUNK) + t0 + i - base, sizeof pair);
                    const __m256i pp = _mm256_set1_epi32(pair);
                    lo_acc[b] = ps_dpwssd8(lo_acc[b], lo, pp);
                    hi_acc[b] = ps_dpwssd8(hi_acc[b], hi, pp);
                }
            }
        }
        /* lanes: lo = dims 0-3 and 8-11 of the chunk, hi = 4-7 and 12-15 */
        for (int b = 0; b < nq; b++) {
            const __m256 scale = _mm256_set1_ps(ps[qq0 + b]);
            const __m256 first = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo_acc[b], hi_acc[b], 0x20));
            const __m256 second = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo_acc[b], hi_acc[b], 0x31));
            float *dst = part + (qq0 + b) * stride + 16 * c;
            _mm256_storeu_ps(dst, _mm256_mul_ps(first, scale));
            _mm256_storeu_ps(dst + 8, _mm256_mul_ps(second, scale));
        }
    }
}
#endif

INLINE void values_i8(const DecodeArgs *a, const Keys *k, int64_t h, const float *scores, const float *ps,
                      float *part, int64_t qq0, const int nq, const int64_t chunks) {
#if defined(PS_AVX2_ONLY)
    values_i8_avx2(a, k, h, scores, ps, part, qq0, nq, chunks);
#else
    const int64_t bs = a->block_size, dim = 16 * chunks, stride = partial_stride(dim), base = k->k0 - k->k0 % 2;
    if (chunks == 4) VALUES_I8(2);          /* head_dim 64 */
    else if (chunks == 8) VALUES_I8(4);     /* head_dim 128 */
    else VALUES_I8((chunks + 1) / 2);       /* other multiples of 16: the runtime count */
#endif
}
#undef VALUES_I8

#endif
