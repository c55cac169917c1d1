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
 * Where the build has AMX and the OS grants the tile state, both products run on tiles in the same layouts
 * (scores_amx: S^T = K Q^T; accumulate_amx: O^T += V^T P^T), which made the kernel 2.6-3.8x the fp32-FMA kernel and
 * 0.9-1.4x torch's SDPA on bf16 caches (docs/benchmarks.md). P is rounded to bf16 before P x V, as torch's own CPU
 * flash attention rounds it, and the row sums add the rounded values, so each output row stays a convex combination
 * of V rows. Products of bf16 values are exact in fp32: besides that rounding, only the summation order differs from
 * the torch path (kernels/torch_attention.py).
 */
#include "prefill_attention.h"
#include "dense_linear.h"  /* ps_amx_ready, TileConfig */

/* Whether bf16 queries of this head dim take AMX tiles here (the build has them, the OS granted the tile state). */
int pagedserve_prefill_amx(int64_t head_dim) {
#if defined(PS_AMX)
    return head_dim % 32 == 0 && ps_amx_ready();
#else
    (void)head_dim;
    return 0;
#endif
}

#if defined(PS_AVX512_BF16)

/* The task's queries as dimension pairs over rows, q[p * rp + r], rows padded to rp (a multiple of 16) with zero
 * queries at the last row's position; positions in pos[r]; m, l and acc reset. Returns rp. */
INLINE int64_t load_queries(const PrefillArgs *a, const Task *t, Tile *w, const int64_t dim) {
    const int64_t group = a->num_heads / a->num_kv_heads, rows = t->rows * group, rp = (rows + 15) / 16 * 16;
    const int64_t first = a->seq_lens[t->s] - a->query_lens[t->s] + t->j0;
    uint32_t *q = (uint32_t *)w->q;
    int32_t *pos = (int32_t *)w->correction;
    for (int64_t r = 0; r < rp; r++) {
        const int64_t row = a->rows[t->s] + t->j0 + r / group, head = t->h * group + r % group;
        const uint32_t *src = (const uint32_t *)((const uint16_t *)a->query + row * a->q_token_stride + head * dim);
        for (int64_t p = 0; p < dim / 2; p++) q[p * rp + r] = r < rows ? src[p] : 0;
        pos[r] = (int32_t)(first + (r < rows ? r : rows - 1) / group);
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * (size_t)(dim * rp));
    return rp;
}

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

/* Online-softmax update of 16 row lanes for keys [k0, k0 + n): raw scores s[i * rp] times `factor`, masked by each
 * lane's position (and window), become bf16 probabilities stored in place as pairs (key 2 i2 low, 2 i2 + 1 high) at
 * s[i2 * rp]. Returns the factor the lanes' accumulators must be scaled by. */
INLINE __m512 softmax_block(float *s, float *m, float *l, const int32_t *pos, float factor, int64_t k0, int64_t n,
                            int64_t window, const int64_t rp) {
    const __m512i position = _mm512_loadu_si512(pos);
    const __m512i lo = window > 0 ? _mm512_sub_epi32(position, _mm512_set1_epi32((int)window - 1))
                                  : _mm512_set1_epi32(INT32_MIN);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(factor);
    __m512 peak = neg_inf;
    for (int64_t i = 0; i < n; i++) {
        const __m512i key = _mm512_set1_epi32((int)(k0 + i));
        const __mmask16 visible = _mm512_cmple_epi32_mask(key, position) & _mm512_cmpge_epi32_mask(key, lo);
        const __m512 x = _mm512_mask_mul_ps(neg_inf, visible, _mm512_load_ps(s + i * rp), scale);
        _mm512_store_ps(s + i * rp, x);
        peak = _mm512_max_ps(peak, x);
    }
    const __m512 old_max = _mm512_load_ps(m), new_max = _mm512_max_ps(old_max, peak);
    f32x16 diff;
    _mm512_storeu_ps((float *)&diff, _mm512_sub_ps(old_max, new_max));
    /* 1 where the max stayed (also -inf to -inf, whose difference is NaN) */
    const __m512 correction = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(old_max, new_max, _CMP_EQ_OQ),
                                                   (__m512)exp16_nonpositive(diff), _mm512_set1_ps(1.0f));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i2 = 0; 2 * i2 < n; i2++) {
        __m512i pair = _mm512_setzero_si512();
        for (int64_t e = 0; e < 2 && 2 * i2 + e < n; e++) {
            const __m512 x = _mm512_load_ps(s + (2 * i2 + e) * rp);
            f32x16 d;
            _mm512_storeu_ps((float *)&d, _mm512_sub_ps(x, new_max));
            /* masked lanes are -inf: zero, also where new_max is -inf too */
            const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ),
                                                 (__m512)exp16_nonpositive(d));
            const __m512i bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p));
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
            pair = _mm512_or_si512(pair, e ? _mm512_slli_epi32(bits, 16) : bits);
        }
        _mm512_store_si512(s + i2 * rp, pair);
    }
    _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), correction, sum));
    _mm512_store_ps(m, new_max);
    return correction;
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

#if defined(PS_AMX)
static void configure_tiles(void) {
    TileConfig config = ps_amx_full_tiles();
    config.colsb[5] = 32;  /* V^T: 16 dimensions x 16 keys */
    config.rows[6] = 8;    /* P: 8 key pairs x 16 row lanes */
    _tile_loadconfig(&config);
}

#define AMX_SCORES(T) if (nrb > T) { _tile_loadd(4, q + 16 * c * rp + 16 * (b0 + T), rp * 4); _tile_dpbf16ps(T, 3, 4); }
#define AMX_STORE(T) if (nrb > T) _tile_stored(T, s + 16 * (b0 + T), rp * 4)

/* S^T = K Q^T on AMX tiles: A = 16 K rows x 32 dimensions as they lie, B = the queries' dimension pairs over 16 row
 * lanes (w->q's layout), C = S^T[key][16 lanes], up to 3 row blocks per pass (tiles 0-2; A in 3, B in 4). */
static void scores_amx(const uint16_t *k, const uint32_t *q, float *s, const int64_t rp, const int64_t dim) {
    for (int64_t b0 = 0; b0 < rp / 16; b0 += 3) {
        const int64_t nrb = rp / 16 - b0 < 3 ? rp / 16 - b0 : 3;
        _tile_zero(0); _tile_zero(1); _tile_zero(2);
        for (int64_t c = 0; c < dim / 32; c++) {
            _tile_loadd(3, k + 32 * c, dim * 2);
            AMX_SCORES(0) AMX_SCORES(1) AMX_SCORES(2)
        }
        AMX_STORE(0); AMX_STORE(1); AMX_STORE(2);
    }
}

/* acc^T = acc^T * correction + V^T P^T on AMX tiles (K = the tile's 16 keys): A = V^T, 16 dimensions x 16 keys,
 * the V pairs transposed as 32-bit words into vt (tile 5); B = 8 P pairs x 16 row lanes (tile 6); C = acc^T (tile 7),
 * scaled beforehand where a lane's correction is not 1. Pairs at or past `pairs` (n < 16 keys) have zero V and P
 * (the score rows there may hold -inf, and -inf times zero is NaN). */
static void accumulate_amx(float *acc, uint32_t *p, const uint32_t *v, const __m512 *correction, uint32_t *vt,
                           const int64_t rp, const int64_t dim, int64_t pairs) {
    for (int64_t i2 = pairs; i2 < KT / 2; i2++) memset(p + i2 * rp, 0, sizeof(uint32_t) * (size_t)rp);
    for (int64_t b = 0; b < rp / 16; b++)
        if (_mm512_cmp_ps_mask(correction[b], _mm512_set1_ps(1.0f), _CMP_NEQ_UQ))
            for (int64_t d = 0; d < dim; d++) {
                float *x = acc + d * rp + 16 * b;
                _mm512_store_ps(x, _mm512_mul_ps(_mm512_load_ps(x), correction[b]));
            }
    for (int64_t d = 0; d < dim; d++)
        for (int64_t i2 = 0; i2 < KT / 2; i2++) vt[d * 8 + i2] = i2 < pairs ? v[i2 * dim + d] : 0;
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
        _tile_loadd(5, vt + d0 * 8, 32);
        for (int64_t b = 0; b < rp / 16; b++) {
            _tile_loadd(6, p + 16 * b, rp * 4);
            _tile_loadd(7, acc + d0 * rp + 16 * b, rp * 4);
            _tile_dpbf16ps(7, 5, 6);
            _tile_stored(7, acc + d0 * rp + 16 * b, rp * 4);
        }
    }
}
#endif

/* Scores (AMX tiles when `amx`), softmax and P x V of one key tile for every row lane of the task. */
INLINE void tile_step(Tile *w, const uint16_t *k, float factor, int64_t k0, int64_t n, int64_t window,
                      const int64_t rp, const int64_t dim, int amx) {
    const uint32_t *q = (const uint32_t *)w->q, *v = (const uint32_t *)w->v, *p = (const uint32_t *)w->p;
    float *s = w->p;
#if defined(PS_AMX)
    if (amx) scores_amx(k, q, s, rp, dim);
#endif
    for (int64_t i = 0; i < n && !amx; i += 8) {
#define SCORES(nrb) score_block(q + 16 * b0, (const uint32_t *)k + i * dim / 2, s + i * rp + 16 * b0, rp, dim / 2, nrb)
        ROW_BLOCKS(rp, b0, SCORES)
#undef SCORES
    }
    __m512 correction[rp / 16];
    for (int64_t b = 0; b < rp / 16; b++)
        correction[b] = softmax_block(s + 16 * b, w->m + 16 * b, w->l + 16 * b, (const int32_t *)w->correction + 16 * b,
                                      factor, k0, n, window, rp);
#if defined(PS_AMX)
    if (amx) return accumulate_amx(w->acc, (uint32_t *)s, v, correction, (uint32_t *)w->k, rp, dim, (n + 1) / 2);
#endif
#define ACCUMULATE(nrb) accumulate_block(w->acc + 16 * b0, p + 16 * b0, v, correction + b0, rp, dim, (n + 1) / 2, nrb)
    ROW_BLOCKS(rp, b0, ACCUMULATE)
#undef ACCUMULATE
}

INLINE void task(const PrefillArgs *a, const Task *t, Tile *w, const int64_t dim, const int kv_dt) {
    const int64_t group = a->num_heads / a->num_kv_heads, bs = a->block_size, rows = t->rows * group;
    const int64_t first_pos = a->seq_lens[t->s] - a->query_lens[t->s] + t->j0, end = first_pos + t->rows;
    const int64_t first = a->window > 0 && first_pos >= a->window ? first_pos - a->window + 1 : 0;
    const int32_t *table = a->block_tables + t->s * a->block_table_stride;
    const size_t block_bytes = (size_t)bs * dim * elem_size(kv_dt);
    const float factor = a->scale * a->k_scale[t->h];
    const int64_t rp = load_queries(a, t, w, dim);
#if defined(PS_AMX)
    const int amx = pagedserve_prefill_amx(dim);
    if (amx) configure_tiles();
#else
    const int amx = 0;
#endif
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
            tile_step(w, k, factor, b * bs + i0, n, a->window, rp, dim, amx);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = a->rows[t->s] + t->j0 + r / group, head = t->h * group + r % group;
        uint16_t *dst = (uint16_t *)a->out + (row * a->num_heads + head) * dim;
        const float factor_out = a->v_scale[t->h] / w->l[r];
        for (int64_t d = 0; d < dim; d++) dst[d] = f32_to_bf16(w->acc[d * rp + r] * factor_out);
    }
#if defined(PS_AMX)
    if (amx) _tile_release();
#endif
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
