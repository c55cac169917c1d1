/* The AVX2 build's score_rows and accumulate_rows for prefill_attention.c (included there, in place of its 16-lane
 * forms, where a 16-lane vector is two ymm halves): the 16-lane forms kept their accumulators and each broadcast query
 * or probability on the stack there, built lane by lane (a stalled store-to-load forward each), whatever gcc's tuning
 * (docs/benchmarks.md, "AVX2 prefill attention"). The same products and sums in the same order, so every build gives
 * the same bits (tests/test_native_prefill.py). */
#ifndef PAGEDSERVE_CPU_PREFILL_YMM_H
#define PAGEDSERVE_CPU_PREFILL_YMM_H

#include "prefill_attention.h"

enum { SCORE_ROWS = 4 };  /* 4 rows x 2 halves of accumulators, a K column's 2 halves and a broadcast: 11 of 16 ymm */

/* Scores of `rows` query rows against the transposed tile: p[r * KT + i], SCORE_ROWS rows a pass; a last partial pass
 * repeats its last row (computed, not stored), so the trip count stays a constant and the sums stay in registers. */
INLINE void score_rows(const Tile *w, int64_t rows, const int64_t dim) {
    for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS) {
        const int64_t m = rows - r0 < SCORE_ROWS ? rows - r0 : SCORE_ROWS;
        const float *q[SCORE_ROWS];
        __m256 lo[SCORE_ROWS], hi[SCORE_ROWS];
        for (int j = 0; j < SCORE_ROWS; j++) {
            q[j] = w->q + r0 + (j < m ? j : m - 1);
            lo[j] = hi[j] = _mm256_setzero_ps();
        }
        for (int64_t d = 0; d < dim; d++) {
            const __m256 k0 = _mm256_loadu_ps(w->k + 16 * d), k1 = _mm256_loadu_ps(w->k + 16 * d + 8);
            for (int j = 0; j < SCORE_ROWS; j++) {
                const __m256 qj = _mm256_broadcast_ss(q[j] + d * rows);
                lo[j] = _mm256_fmadd_ps(qj, k0, lo[j]);
                hi[j] = _mm256_fmadd_ps(qj, k1, hi[j]);
            }
        }
        for (int64_t j = 0; j < m; j++) {
            _mm256_storeu_ps(w->p + (r0 + j) * KT, lo[j]);
            _mm256_storeu_ps(w->p + (r0 + j) * KT + 8, hi[j]);
        }
    }
}

/* Dimensions [e0, e0 + 8 n) of two accumulator rows a and b (n <= 4 a constant: 2n ymm of sums): scaled by their
 * corrections, plus their probabilities pa[i], pb[i] times the V rows. */
INLINE void accumulate_pass(float *a, float *b, __m256 ca, __m256 cb, const float *pa, const float *pb,
                            const float *v, int64_t dim, int64_t e0, const int n) {
    __m256 x[4], y[4];
    for (int u = 0; u < n; u++) {
        x[u] = _mm256_mul_ps(_mm256_loadu_ps(a + e0 + 8 * u), ca);
        y[u] = _mm256_mul_ps(_mm256_loadu_ps(b + e0 + 8 * u), cb);
    }
    for (int64_t i = 0; i < KT; i++) {
        const __m256 px = _mm256_broadcast_ss(pa + i), py = _mm256_broadcast_ss(pb + i);
        for (int u = 0; u < n; u++) {
            const __m256 vu = _mm256_loadu_ps(v + i * dim + e0 + 8 * u);
            x[u] = _mm256_fmadd_ps(px, vu, x[u]);
            y[u] = _mm256_fmadd_ps(py, vu, y[u]);
        }
    }
    for (int u = 0; u < n; u++) {  /* b first: when a is b (an odd last row) both hold the same sums */
        _mm256_storeu_ps(b + e0 + 8 * u, y[u]);
        _mm256_storeu_ps(a + e0 + 8 * u, x[u]);
    }
}

/* acc[r] = acc[r] * correction[r] + sum_i p[r, i] * V[i] for `rows` rows, V given as fp32 rows v[i * dim]; two rows
 * and 32 of their dimensions a pass, so that each V load serves two rows. */
INLINE void accumulate_rows(float *acc, const float *p, const float *correction, int64_t rows, const float *v,
                            const int64_t chunks) {
    const int64_t dim = 16 * chunks;
    for (int64_t r = 0; r < rows; r += 2) {
        const int64_t second = r + 1 < rows ? r + 1 : r;  /* an odd last row is computed twice, stored once */
        float *a = acc + r * dim, *b = acc + second * dim;
        const __m256 ca = _mm256_set1_ps(correction[r]), cb = _mm256_set1_ps(correction[second]);
        int64_t e0 = 0;
        for (; e0 + 32 <= dim; e0 += 32) accumulate_pass(a, b, ca, cb, p + r * KT, p + second * KT, v, dim, e0, 4);
        if (e0 < dim) accumulate_pass(a, b, ca, cb, p + r * KT, p + second * KT, v, dim, e0, 2);
    }
}

#endif
