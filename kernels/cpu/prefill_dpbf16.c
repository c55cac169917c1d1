/* Prefill attention for bf16 queries with AVX512-BF16 (vdpbf16ps): one task of prefill_attention.c, 16 query
 * positions of a chunk times the query heads of one KV head, against every key tile they can see.
 *
 * Why a layout of its own: the fp32 kernel puts 16 keys in a vector, so its online softmax needs a horizontal max
 * and sum per row and tile, and its P x V ran in fp32 FMAs. Here every vector
 * runs over 16 of the task's rows (row r: position j0 + r / group, head h * group + r % group):
 *  - scores S^T[key][rows] = sum over dimension pairs of vdpbf16ps(Q pairs of 16 rows, broadcast K pair): K rows are
 *    read where they lie in the cache, not transposed;
 *  - the softmax's max, exp, sum and rescaling are lane-wise, with no horizontal operation;
 *  - P x V: acc^T[d][rows] += vdpbf16ps(16 rows' P pairs of keys (2i, 2i + 1), broadcast (V[2i][d], V[2i+1][d])).
 * Where the build has AMX and the OS grants the tile state, prefill_amx.c runs both products on tiles in the same
 * layouts. Products of bf16 values are exact in fp32: besides P's rounding (prefill_bf16.h), only the summation
 * order differs from the torch path (kernels/torch_attention.py).
 */
#include "prefill_bf16.h"

#if defined(PS_AVX512_BF16)

/* The tile's K rows as a [KT][dim] bf16 matrix: in place for a bf16 cache's full tile, otherwise copied or
 * dequantized into w->k, rows past n zero (a stale slot may hold NaN). */
INLINE const uint16_t *k_rows(const char *block, const _Float16 *rs, int64_t i0, int64_t n, const int64_t dim,
                              const int kv_dt, Tile *w) {
    if (kv_dt == DT_BF16 && n == KT) return (const uint16_t *)block + i0 * dim;
    uint16_t *k = (uint16_t *)w->k;
    for (int64_t i = 0; i < n; i++) {
        const char *row = block + (i0 + i) * dim * elem_size(kv_dt);
        if (kv_dt == DT_BF16) {
            memcpy(k + i * dim, row, sizeof(uint16_t) * (size_t)dim);
            continue;
        }
        for (int64_t c = 0; c < dim / 16; c++) {
            f32x16 x = load16(row, c, kv_dt);
            if (kv_dt == DT_I8) x *= (float)rs[i0 + i];  /* dequantized, then rounded as the torch gather rounds */
            const u16x16 bits = bf16x16_bits(x);
            memcpy(k + i * dim + 16 * c, &bits, sizeof bits);
        }
    }
    memset(k + n * dim, 0, sizeof(uint16_t) * (size_t)((KT - n) * dim));
    return k;
}

/* The tile's V rows as pairs v[i2 * dim + d] = (V[2 i2][d], V[2 i2 + 1][d]); rows past n are zero (a stale slot
 * may hold NaN, and NaN times a zero probability is still NaN). */
INLINE void v_pairs(const char *block, const _Float16 *rs, int64_t i0, int64_t n, const int64_t dim, const int kv_dt,
                    uint32_t *v) {
    for (int64_t i2 = 0; 2 * i2 < n; i2++) {
        for (int64_t c = 0; c < dim / 16; c++) {
            u32x16 half[2] = {{0}, {0}};
            for (int64_t e = 0; e < 2 && 2 * i2 + e < n; e++) {
                const int64_t i = i0 + 2 * i2 + e;
                const char *row = block + i * dim * elem_size(kv_dt);
                u16x16 bits;
                if (kv_dt == DT_BF16) memcpy(&bits, (const uint16_t *)row + 16 * c, sizeof bits);
                else bits = bf16x16_bits(load16(row, c, kv_dt) * (kv_dt == DT_I8 ? (float)rs[i] : 1.0f));
                half[e] = __builtin_convertvector(bits, u32x16);
            }
            const u32x16 pair = half[0] | half[1] << 16;
            memcpy(v + i2 * dim + 16 * c, &pair, sizeof pair);
        }
    }
}

#define DP(acc, x, y) _mm512_dpbf16_ps((acc), (__m512bh)(x), (__m512bh)(y))

/* Scores of 8 keys against 16 * nrb row lanes (nrb <= 3), s[i * rp + lane]: 8 * nrb accumulator chains side by
 * side, each query vector loaded once per 8 keys and each K pair broadcast once per 16 * nrb rows. */
INLINE void score_block(const uint32_t *q, const uint32_t *k, float *s, const int64_t rp, const int64_t pairs,
                        const int nrb) {
    __m512 x[3][8];
    for (int b = 0; b < nrb; b++)
        for (int j = 0; j < 8; j++) x[b][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512i qv[3];
        for (int b = 0; b < nrb; b++) qv[b] = _mm512_load_si512(q + p * rp + 16 * b);
        for (int j = 0; j < 8; j++) {
            const __m512i kk = _mm512_set1_epi32((int)k[j * pairs + p]);
            for (int b = 0; b < nrb; b++) x[b][j] = DP(x[b][j], qv[b], kk);
        }
    }
    for (int b = 0; b < nrb; b++)
        for (int j = 0; j < 8; j++) _mm512_store_ps(s + j * rp + 16 * b, x[b][j]);
}

/* acc^T[d][lanes] = acc^T * correction + sum over key pairs of P pairs times V pairs, for 16 * nrb row lanes
 * (nrb <= 3), 8 dimensions at a time: each P vector loaded once per 8 dimensions, each V pair broadcast once per
 * 16 * nrb rows. */
INLINE void accumulate_block(float *acc, const uint32_t *p, const uint32_t *v, const __m512 *correction,
                             const int64_t rp, const int64_t dim, int64_t pairs, const int nrb) {
    for (int64_t d0 = 0; d0 < dim; d0 += 8) {
        __m512 x[3][8];
        for (int b = 0; b < nrb; b++)
            for (int j = 0; j < 8; j++)
                x[b][j] = _mm512_mul_ps(_mm512_load_ps(acc + (d0 + j) * rp + 16 * b), correction[b]);
        for (int64_t i2 = 0; i2 < pairs; i2++) {
            __m512i pv[3];
            for (int b = 0; b < nrb; b++) pv[b] = _mm512_load_si512(p + i2 * rp + 16 * b);
            for (int j = 0; j < 8; j++) {
                const __m512i vv = _mm512_set1_epi32((int)v[i2 * dim + d0 + j]);
                for (int b = 0; b < nrb; b++) x[b][j] = DP(x[b][j], pv[b], vv);
            }
        }
        for (int b = 0; b < nrb; b++)
            for (int j = 0; j < 8; j++) _mm512_store_ps(acc + (d0 + j) * rp + 16 * b, x[b][j]);
    }
}

/* f(..., nrb) for the row blocks [b0, b0 + 3) of the tile, with nrb a constant. */
#define ROW_BLOCKS(rp, b0, call) \
    for (int64_t b0 = 0; b0 < (rp) / 16; b0 += 3) { \
        const int64_t left = (rp) / 16 - b0; \
        if (left >= 3) call(3); else if (left == 2) call(2); else call(1); \
    }

/* Scores, softmax and P x V of one key tile for every row lane of the task. */
INLINE void tile_step(Tile *w, const uint16_t *k, float factor, int64_t k0, int64_t n, int64_t window,
                      const int64_t rp, const int64_t dim) {
    const uint32_t *q = (const uint32_t *)w->q, *v = (const uint32_t *)w->v, *p = (const uint32_t *)w->p;
    float *s = w->p;
    for (int64_t i = 0; i < n; i += 8) {
#define SCORES(nrb) score_block(q + 16 * b0, (const uint32_t *)k + i * dim / 2, s + i * rp + 16 * b0, rp, dim / 2, nrb)
        ROW_BLOCKS(rp, b0, SCORES)
#undef SCORES
    }
    __m512 correction[rp / 16];
    for (int64_t b = 0; b < rp / 16; b++)
        correction[b] = softmax_block(s + 16 * b, w->m + 16 * b, w->l + 16 * b, (const int32_t *)w->correction + 16 * b,
                                      factor, k0, n, window, rp, 0);
#define ACCUMULATE(nrb) accumulate_block(w->acc + 16 * b0, p + 16 * b0, v, correction + b0, rp, dim, (n + 1) / 2, nrb)
    ROW_BLOCKS(rp, b0, ACCUMULATE)
#undef ACCUMULATE
}

INLINE void task(const PrefillArgs *a, const Task *t, Tile *w, const int64_t dim, const int kv_dt) {
    const int64_t bs = a->block_size;
    const int64_t first_pos = a->seq_lens[t->s] - a->query_lens[t->s] + t->j0, end = first_pos + t->rows;
    const int64_t first = a->window > 0 && first_pos >= a->window ? first_pos - a->window + 1 : 0;
    const int32_t *table = a->block_tables + t->s * a->block_table_stride;
    const size_t block_bytes = (size_t)bs * dim * elem_size(kv_dt);
    const float factor = a->scale * a->k_scale[t->h];
    const int64_t rp = load_queries(a, t, w, dim);
    for (int64_t b = first / bs; b * bs < end; b++) {
        const size_t tile = (size_t)(t->h * a->num_blocks + table[b]);
        const char *kb = (const char *)a->k_cache + tile * block_bytes;
        const char *vb = (const char *)a->v_cache + tile * block_bytes;
        const _Float16 *krs = kv_dt == DT_I8 ? a->k_row_scale + tile * bs : NULL;
        const _Float16 *vrs = kv_dt == DT_I8 ? a->v_row_scale + tile * bs : NULL;
        const int64_t lo = b == first / bs ? (first - b * bs) / KT * KT : 0, hi = end - b * bs < bs ? end - b * bs : bs;
        for (int64_t i0 = lo; i0 < hi; i0 += KT) {
            const int64_t n = hi - i0 < KT ? hi - i0 : KT;
            const uint16_t *k = k_rows(kb, krs, i0, n, dim, kv_dt, w);
            v_pairs(vb, vrs, i0, n, dim, kv_dt, (uint32_t *)w->v);
            tile_step(w, k, factor, b * bs + i0, n, a->window, rp, dim);
        }
    }
    store_rows(a, t, w, rp, dim);
}

#define SPECIALIZE(D, KV) \
    if (a->head_dim == D && a->kv_dtype == KV) return task(a, t, w, D, KV)

void prefill_task_dpbf16(const PrefillArgs *a, const Task *t, Tile *w) {
    SPECIALIZE(64, DT_BF16); SPECIALIZE(128, DT_BF16);
    SPECIALIZE(64, DT_E4M3); SPECIALIZE(128, DT_E4M3);
    SPECIALIZE(64, DT_E5M2); SPECIALIZE(128, DT_E5M2);
    SPECIALIZE(64, DT_I8); SPECIALIZE(128, DT_I8);
    task(a, t, w, a->head_dim, a->kv_dtype);  /* head_dim a multiple of 16 (the caller checked) */
}

#endif
