/* Decode attention's scores: the span's queries against one chunk of keys read in place from the paged cache
 * (fp32 dots over 16-bit and FP8 keys widened once per 16-key group; int16 pair dots over int8 keys), with the
 * prefetches that keep the scattered K tiles and this tile's V ahead of the loads. Included by decode_attention.c
 * only (its specializations inline these with constant chunk counts). */
#ifndef PAGEDSERVE_CPU_DECODE_SCORES_H
#define PAGEDSERVE_CPU_DECODE_SCORES_H
#include "isa.h"
#include "decode_chunks.h"
#include "kv_dot.h"

/* out[j] = the sum of v[j]'s 16 lanes, for 16 vectors at once: a transpose-add tree of 15 steps instead of 16
 * horizontal sums (about a third of the shuffles and adds). */
INLINE f32x16 hsum16x16(const f32x16 *v) {
    f32x16 c[8], d[4], e[2];
    for (int j = 0; j < 8; j++)
        c[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * j], v[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)
        d[j] = __builtin_shufflevector(c[2 * j], c[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(c[2 * j], c[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)
        e[j] = __builtin_shufflevector(d[2 * j], d[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(d[2 * j], d[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Key row r's lines in a later K tile and in this tile's V, both into L2 (locality 2: prefetcht1), spread over the
 * key loops: a burst of 2 * tile_bytes / 64 prefetches would fill the miss buffers and stall on them. Into L1, the K
 * prefetches held L1 miss buffers the loads of the rows being scored waited for, and evicted rows not yet read; into
 * L2, from ~4 KiB ahead (chunk_scores), the loads find them there (benchmarks/decode_attention_ab.py, this host's
 * figures in docs/kv-cache-formats.md). V goes to L2 for the same reason: the values pass reads it a chunk later
 * (KEY_CHUNK keys, 32-64 KiB of V at head dim 64). */
INLINE void prefetch_row(const char *next_k, const char *v_tile, int64_t r, size_t kv_row) {
    for (size_t line = 0; line < kv_row; line += 64) {
        __builtin_prefetch(next_k + r * kv_row + line, 0, 2);
        __builtin_prefetch(v_tile + r * kv_row + line, 0, 2);
    }
}

/* One query's scores of a 16-key group (m of them real) into its row of the chunk's scores: a constant size is one
 * or two stores; a variable one became `rep movsq` (~10% of the kernel). */
INLINE void store_scores(float *dst, const void *sums, int64_t m) {
    if (m == 16) memcpy(dst, sums, 16 * sizeof(float));
    else memcpy(dst, sums, sizeof(float) * (size_t)m);
}

/* Scores of 16 keys (m of them real, from key row i0 of `tile`) for all the span's queries: the keys widened to
 * fp32 once for all queries; each query's 16 dot vectors then stay in registers up to their lane sums (a
 * [query][key] buffer of them cost a store and a load each). The prefetches (prefetch_row) run ahead to `next_k`
 * and this tile's V. */
INLINE void score16(const char *tile, const char *next_k, const char *v_tile, int64_t i0, int64_t m, const f32x16 *q,
                    int64_t nq, float *dst, const int64_t chunks, const int kv_dt) {
    const size_t kv_row = (size_t)16 * chunks * elem_size(kv_dt);
    f32x16 kf[16][chunks];
    for (int64_t i = 0; i < 16; i++) {
        if (i >= m) {
            for (int64_t c = 0; c < chunks; c++) kf[i][c] = (f32x16){0};
            continue;
        }
        prefetch_row(next_k, v_tile, i0 + i, kv_row);
        kv_widen_row(tile + (i0 + i) * kv_row, chunks, kv_dt, kf[i]);
    }
    for (int64_t qq = 0; qq < nq; qq++) {
        f32x16 dots[16];
        for (int64_t i = 0; i < 16; i++) {
            f32x16 dot = q[qq * chunks] * kf[i][0];
#if defined(PS_AVX512)
            /* each chunk's products added by an FMA into the sum so far, as score16_avx2 does: left to contraction,
             * gcc fused the first two chunks' products either way round (the other way for fp32 and FP8 rows) */
            for (int64_t c = 1; c < chunks; c++)
                dot = (f32x16)_mm512_fmadd_ps((__m512)q[qq * chunks + c], (__m512)kf[i][c], (__m512)dot);
#else
            for (int64_t c = 1; c < chunks; c++) dot += q[qq * chunks + c] * kf[i][c];
#endif
            dots[i] = dot;
        }
        const f32x16 sums = hsum16x16(dots);
        store_scores(dst + qq * KEY_CHUNK, &sums, m);
    }
}

/* score16 for int8 K (kv_dot.h): each key's int32 dot with the int16 queries q16 ([nq][chunks], each chunk twice),
 * times the query's scale qs[qq] and the key row's scale. Keys go in pairs, one pair per vector (kv_dot_widen_pair):
 * the lane sums then take 14 shuffles per query and 16 keys instead of 30. */
INLINE void score16_i8(const char *tile, int64_t i0, int64_t m, const i16x32 *q16, const float *qs, int64_t nq,
                       float *dst, const _Float16 *rs, const int64_t chunks) {
    const size_t kv_row = (size_t)16 * chunks;
    const int8_t *rows = (const int8_t *)tile + i0 * kv_row;
    const f32x16 row_scale = row_scales16(rs + i0, m);
    /* The 16 keys widened once into L1 for all the queries, which then read them as memory operands of the pair
     * dots: widening per query from the rows put three times the widening on port 5 at a row's 3 queries per KV
     * head (1.15x the int8 kernel's time with the data in cache, 1 thread), more at a span's 15. */
    i16x32 kw[8][chunks];
    if (m == 16)  /* a whole group: no absent rows to test for */
        for (int64_t j = 0; j < 8; j++)
            for (int64_t c = 0; c < chunks; c++)
                kw[j][c] = kv_dot_widen_pair(rows + 2 * j * kv_row, rows + (2 * j + 1) * kv_row, c);
    else
        for (int64_t j = 0; j < 8; j++) {
            const int8_t *a = 2 * j < m ? rows + 2 * j * kv_row : NULL;
            const int8_t *b = 2 * j + 1 < m ? rows + (2 * j + 1) * kv_row : NULL;
            for (int64_t c = 0; c < chunks; c++) kw[j][c] = kv_dot_widen_pair(a, b, c);
        }
    for (int64_t qq = 0; qq < nq; qq++) {
        i32x16 dots[8];
        for (int64_t j = 0; j < 8; j++) {
            i32x16 dot = {0};
            for (int64_t c = 0; c < chunks; c++) dot = kv_dot_pairs(dot, kw[j][c], q16[qq * chunks + c]);
            dots[j] = dot;
        }
        const f32x16 sums = __builtin_convertvector(kv_dot_hsum_key_pairs(dots), f32x16) * qs[qq] * row_scale;
        store_scores(dst + qq * KEY_CHUNK, &sums, m);
    }
}

#if defined(PS_AVX2_ONLY)
/* hsum16x16's sums of 8 keys' dot vectors in ymm halves (lo[i], hi[i]: lanes 0-7 and 8-15 of key i's), the same
 * additions in the same order, so the same bits: lane i + lane i + 8, then + the lane 4 on, then 2 on, then 1 on. */
INLINE __m256 score_hsum8(const __m256 *lo, const __m256 *hi) {
    __m256 y[8], d[4], e[2];
    for (int i = 0; i < 8; i++) y[i] = _mm256_add_ps(lo[i], hi[i]);
    for (int i = 0; i < 4; i++)  /* [key 2i: 4 sums | key 2i + 1: 4 sums] */
        d[i] = _mm256_add_ps(_mm256_permute2f128_ps(y[2 * i], y[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(y[2 * i], y[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)  /* [keys 4i, 4i + 2: 2 sums each | keys 4i + 1, 4i + 3] */
        e[i] = _mm256_add_ps(_mm256_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 keys = _mm256_add_ps(_mm256_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm256_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* `keys` holds keys 0, 2, 4, 6 | 1, 3, 5, 7 */
    return _mm256_permutevar8x32_ps(keys, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* score16 for AVX2 without AVX-512, the same products, sums and order in ymm halves: the 16-lane code kept 16 keys'
 * widened rows and dot vectors as 64-byte values that gcc moved through the stack, and built hsum16x16's shuffles
 * lane by lane (the score half was 59% of the AVX2 build's bf16 decode attention with the data in cache). */
INLINE void score16_avx2(const char *tile, const char *next_k, const char *v_tile, int64_t i0, int64_t m,
                         const f32x16 *q, int64_t nq, float *dst, const int64_t chunks, const int kv_dt) {
    const size_t kv_row = (size_t)16 * chunks * elem_size(kv_dt);
    __m256 kf[16][chunks][2];
    for (int64_t i = 0; i < 16; i++) {
        if (i >= m) {
            for (int64_t c = 0; c < chunks; c++) kf[i][c][0] = kf[i][c][1] = _mm256_setzero_ps();
            continue;
        }
        prefetch_row(next_k, v_tile, i0 + i, kv_row);
        for (int64_t c = 0; c < chunks; c++) kv_row16_halves(tile + (i0 + i) * kv_row, c, kv_dt, kf[i][c]);
    }
    for (int64_t qq = 0; qq < nq; qq++) {
        const __m256 *qv = (const __m256 *)(q + qq * chunks);  /* chunk c: qv[2c], qv[2c + 1] */
        float sums[16];
        for (int64_t half = 0; half < 2; half++) {
            __m256 lo[8], hi[8];
            for (int64_t j = 0; j < 8; j++) {
                const __m256 (*k)[2] = kf[8 * half + j];
                __m256 l = _mm256_mul_ps(_mm256_loadu_ps((const float *)&qv[0]), k[0][0]);
                __m256 h = _mm256_mul_ps(_mm256_loadu_ps((const float *)&qv[1]), k[0][1]);
                for (int64_t c = 1; c < chunks; c++) {
                    l = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)&qv[2 * c]), k[c][0], l);
                    h = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)&qv[2 * c + 1]), k[c][1], h);
                }
                lo[j] = l, hi[j] = h;
            }
            _mm256_storeu_ps(sums + 8 * half, score_hsum8(lo, hi));
        }
        store_scores(dst + qq * KEY_CHUNK, sums, m);
    }
}

/* score16_i8 for AVX2 without AVX-512, the same integer sums and epilogue, in ymm registers: each key's 16-dim
 * chunks widened once into L1, then per query and 8 keys one int32 accumulator per key over its chunks and an 8 x 8
 * transpose-add. The 16- and 32-lane code went through the stack on this target (the 64-byte accumulators, the
 * scores moved lane pairs at a time through general registers): the score half was 62% of the AVX2 build's int8
 * decode attention with the data in cache, against 15% for its values half. */
INLINE void score16_i8_avx2(const char *tile, int64_t i0, int64_t m, const i16x32 *q16, const float *qs,
                            int64_t nq, float *dst, const _Float16 *rs, const int64_t chunks) {
    const size_t kv_row = (size_t)16 * chunks;
    const int8_t *rows = (const int8_t *)tile + i0 * kv_row;
    const f32x16 row_scale = row_scales16(rs + i0, m);
    __m256 row_scales[2];
    memcpy(row_scales, &row_scale, sizeof row_scales);
    __m256i kw[16][chunks];
    for (int64_t i = 0; i < 16; i++)
        for (int64_t c = 0; c < chunks; c++)
            kw[i][c] = i < m ? _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rows + i * kv_row + 16 * c)))
                             : _mm256_setzero_si256();
    for (int64_t qq = 0; qq < nq; qq++) {
        __m256i q[chunks];  /* kv_dot_quantize's chunk c: its first 16 lanes (the second 16 are a copy) */
        for (int64_t c = 0; c < chunks; c++) memcpy(&q[c], &q16[qq * chunks + c], sizeof q[c]);
        const __m256 q_scale = _mm256_set1_ps(qs[qq]);
        float sums[16];
        for (int64_t half = 0; half < 2; half++) {
            __m256i dots[8];
            for (int64_t j = 0; j < 8; j++) {
                __m256i dot = _mm256_setzero_si256();
                for (int64_t c = 0; c < chunks; c++) dot = ps_dpwssd8(dot, kw[8 * half + j][c], q[c]);
                dots[j] = dot;
            }
            const __m256 s = _mm256_cvtepi32_ps(kv_dot_hsum8x8(dots));
            _mm256_storeu_ps(sums + 8 * half, _mm256_mul_ps(_mm256_mul_ps(s, q_scale), row_scales[half]));
        }
        store_scores(dst + qq * KEY_CHUNK, sums, m);
    }
}
#endif

/* Scores of all the span's queries over the chunk's keys: scores[qq * KEY_CHUNK + t - k0]. int8 K: q16 and qs are
 * the queries rounded to int16 and their scales (kv_dot_quantize), q is not read. */
INLINE void chunk_scores(const DecodeArgs *a, const Keys *k, int64_t h, const f32x16 *q, const i16x32 *q16,
                         const float *qs, int64_t nq, float *scores, const int64_t chunks, const int kv_dt) {
    const int64_t bs = a->block_size;
    const size_t tile_bytes = (size_t)bs * 16 * chunks * elem_size(kv_dt);
    /* The K tile prefetched is about 4 KiB of keys ahead (into L2: prefetch_row): 2 KiB into L1 left the loads of
     * an 8-bit or an AVX2 build's tile waiting on memory; 4 KiB into L2 was the best of 2-8 KiB on a Zen 4. */
    const int64_t ahead = tile_bytes >= 4096 ? 1 : (int64_t)(4096 / tile_bytes);
    for (int64_t t0 = k->k0 - k->k0 % bs; t0 < k->k1; t0 += bs) {
        const size_t offset = (size_t)(h * a->num_blocks + k->table[t0 / bs]) * tile_bytes;
        const char *tile = (const char *)a->k_cache + offset;
        const int64_t n = k->k1 - t0 < bs ? k->k1 - t0 : bs, tlo = t0 < k->k0 ? k->k0 - t0 : 0;
        /* Blocks are scattered, so the hardware prefetcher stops at every tile boundary: ask for a later K tile
         * now (past the chunk's end too: the same thread usually takes the next chunk), and for this V tile, which
         * the probs x V loop then finds in cache. */
        const char *next_k = tile;
        if (t0 + ahead * bs < k->hi) {
            const int64_t block = h * a->num_blocks + k->table[t0 / bs + ahead];
            next_k = (const char *)a->k_cache + (size_t)block * tile_bytes;
            if (kv_dt == DT_I8) {  /* the row scales live apart from the rows: a miss per tile each if not asked for */
                __builtin_prefetch(a->k_row_scale + block * bs);
                __builtin_prefetch(a->v_row_scale + block * bs);
            }
        }
        const _Float16 *rs = kv_dt == DT_I8 ? a->k_row_scale + (h * a->num_blocks + k->table[t0 / bs]) * bs : NULL;
        for (int64_t i0 = tlo; i0 < n; i0 += 16) {
            const int64_t m = n - i0 < 16 ? n - i0 : 16;
            if (kv_dt == DT_I8) {
                for (int64_t i = 0; i < m; i++)  /* before the widening, which runs ahead of the dots */
                    prefetch_row(next_k, (const char *)a->v_cache + offset, i0 + i, (size_t)16 * chunks);
#if defined(PS_AVX2_ONLY)
                score16_i8_avx2(tile, i0, m, q16, qs, nq, scores + t0 + i0 - k->k0, rs, chunks);
#else
                score16_i8(tile, i0, m, q16, qs, nq, scores + t0 + i0 - k->k0, rs, chunks);
#endif
            } else
#if defined(PS_AVX2_ONLY)
                score16_avx2(tile, next_k, (const char *)a->v_cache + offset, i0, m, q, nq, scores + t0 + i0 - k->k0,
                             chunks, kv_dt);
#else
                score16(tile, next_k, (const char *)a->v_cache + offset, i0, m, q, nq, scores + t0 + i0 - k->k0,
                        chunks, kv_dt);
#endif
        }
    }
}

#endif
