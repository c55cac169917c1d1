/* Prefill attention over the paged KV cache: every sequence of a step with more than one new token, in one call per
 * layer (built and called by kernels/cpu/native.py; wrapped by kernels/native_attention.py).
 *
 * Why C: torch's path gathers each chunk's blocks (index_select), upcasts them, and runs SDPA once per sequence and
 * layer; at the benchmark's prompt lengths (32-256) SDPA ran at ~40 GFLOP/s and the whole path was 10% of bf16 step
 * time. Here a task is (sequence, KV head, tile of 16 query positions): the query heads sharing that KV head are
 * scored against 16 keys at a time with K transposed into L1 (one FMA per head, dimension and 16 keys, no
 * horizontal sums), under an online softmax (flash attention), reading blocks in place. bf16 queries over bf16 or
 * 8-bit caches take prefill_dpbf16.c instead where the build targets AVX512-BF16 (the same tasks, another layout).
 *
 * Semantics are those of the torch path (kernels/torch_attention.py): fp32 scores and softmax, FP8 K/V times their
 * per-head scale, output rounded once to the query dtype; only the summation order differs.
 * Query row j of a chunk is at absolute position past + j (past = seq_len - q_len) and sees the keys k with
 * k <= past + j and, with a sliding window W, k > past + j - W. Blocks wholly before the first visible key are never
 * read (their block-table entries may be -1).
 */
/* The portable build (CPUs without AVX2) lowers the 16-lane code below to 128-bit pieces, and RTL GCSE (PRE, load
 * CSE after reload) was most of its compile time on every cold build, CI's included: 25.9 -> 10.8 s without it
 * (gcc 12), for a kernel ~5% slower there. Only there: the AVX-512 build ran ~3% slower without it (bf16 queries,
 * benchmarks/prefill_attention_ab.py), and the AVX2 build's ymm passes compile in ~6 s either way. */
#if !defined(__AVX2__)
#pragma GCC optimize("no-gcse", "no-gcse-after-reload")
#endif
#include "prefill_attention.h"

PS_SIZEOF(prefill_args, PrefillArgs)

/* K rows [i0, i0 + n) of one block, transposed into w->k; keys past n are zero. int8 rows are multiplied by their
 * scales rs[i] (the block's row scales) first: dequantized, then rounded to bf16 like the torch path's. */
INLINE void load_k_tile(const char *block, const _Float16 *rs, int64_t i0, int64_t n, const int64_t chunks,
                        const int kv_dt, Tile *w) {
    const size_t kv_row = (size_t)16 * chunks * elem_size(kv_dt);
    for (int64_t i = 0; i < KT; i++) {
        for (int64_t c = 0; c < chunks; c++) {
            f32x16 x = i < n ? load16(block + (i0 + i) * kv_row, c, kv_dt) : (f32x16){0};
            if (kv_dt == DT_I8 && i < n) x *= (float)rs[i0 + i];
            for (int lane = 0; lane < 16; lane++) w->k[(16 * c + lane) * KT + i] = x[lane];
        }
    }
}

#if defined(PS_AVX2_ONLY)
#include "prefill_ymm.h"  /* score_rows and accumulate_rows in ymm registers */
#else
/* Scores of `rows` query rows against the transposed tile: p[r * KT + i]. Eight rows at a time, so that eight
 * accumulator chains run side by side and each K column is loaded once per eight rows. */
INLINE void score_rows(const Tile *w, int64_t rows, const int64_t dim) {
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        const int64_t m = rows - r0 < 8 ? rows - r0 : 8;
        f32x16 acc[8] = {0};
        const float *q = w->q + r0;
        for (int64_t d = 0; d < dim; d++) {
            const f32x16 k = ((const f32x16 *)w->k)[d];
            for (int64_t j = 0; j < m; j++) acc[j] += q[d * rows + j] * k;
        }
        for (int64_t j = 0; j < m; j++) memcpy(w->p + (r0 + j) * KT, &acc[j], sizeof acc[j]);
    }
}
#endif

/* Online-softmax update of one row for keys at positions [k0, k0 + KT): masks what `position` may not see in its
 * (pre-scaled) scores, turns the rest into probabilities against the running max, and returns the factor the
 * row's accumulator must be scaled by (1 when the tile holds no visible key: its probabilities are then zero). */
INLINE float softmax_tile(float *p, float *m, float *l, int64_t k0, int64_t n, int64_t position,
                          int64_t window) {
    const int64_t lo = window > 0 ? position - window + 1 : 0;
    const f32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, neg_inf = (f32x16){0} - INFINITY;
    /* Visible lanes i: i < n and lo <= k0 + i <= position, as lane bounds (small integers, exact in floats). */
    const float first = (float)(lo - k0 > 0 ? lo - k0 : 0), last = (float)(position - k0 < n - 1 ? position - k0 : n - 1);
    if (last < first) {
        memset(p, 0, sizeof(float) * KT);
        return 1.0f;
    }
    f32x16 scores;
    memcpy(&scores, p, sizeof scores);
    const i32x16 visible = ge16(lane, splat16(first)) & le16(lane, splat16(last));
    scores = select16(visible, scores, neg_inf);
    const float peak = hmax16(scores), new_max = peak > *m ? peak : *m;
    const float correction = exp_nonpositive(*m - new_max);
    const f32x16 probs = select16(visible, exp16_nonpositive(scores - new_max), (f32x16){0});
    memcpy(p, &probs, sizeof probs);
    *l = *l * correction + hsum16(probs);
    *m = new_max;
    return correction;
}

#if !defined(PS_AVX2_ONLY)  /* else prefill_ymm.h's */
/* acc[r] = acc[r] * correction[r] + sum_i p[r, i] * V[i] for `rows` rows, V given as fp32 rows v[i * dim]; two rows
 * at a time, so that each V row is loaded once per two rows and 2 * chunks chains run side by side. */
INLINE void accumulate_rows(float *acc, const float *p, const float *correction, int64_t rows, const float *v,
                            const int64_t chunks) {
    const f32x16 *vv = (const f32x16 *)v;
    for (int64_t r = 0; r < rows; r += 2) {
        const int64_t second = r + 1 < rows ? r + 1 : r;  /* an odd last row is computed twice, stored once */
        f32x16 *a = (f32x16 *)(acc + r * 16 * chunks), *b = (f32x16 *)(acc + second * 16 * chunks);
        f32x16 x[chunks], y[chunks];
        for (int64_t c = 0; c < chunks; c++) x[c] = a[c] * correction[r], y[c] = b[c] * correction[second];
        for (int64_t i = 0; i < KT; i++) {
            const float px = p[r * KT + i], py = p[second * KT + i];
            for (int64_t c = 0; c < chunks; c++) {
                x[c] += px * vv[i * chunks + c];
                y[c] += py * vv[i * chunks + c];
            }
        }
        for (int64_t c = 0; c < chunks; c++) b[c] = y[c], a[c] = x[c];
    }
}
#endif

/* V rows [i0, i0 + n) of one block as fp32 rows; rows past n are zero (their probabilities are zero, and a stale slot
 * may hold NaN, which times zero is still NaN). */
INLINE void load_v_tile(const char *block, const _Float16 *rs, int64_t i0, int64_t n, const int64_t chunks,
                        const int kv_dt, float *v) {
    const size_t kv_row = (size_t)16 * chunks * elem_size(kv_dt);
    f32x16 *out = (f32x16 *)v;
    for (int64_t i = 0; i < KT; i++) {
        const float row_scale = kv_dt == DT_I8 && i < n ? (float)rs[i0 + i] : 1.0f;
        for (int64_t c = 0; c < chunks; c++)
            out[i * chunks + c] = i < n ? load16(block + (i0 + i) * kv_row, c, kv_dt) * row_scale : (f32x16){0};
    }
}

/* Row r of a task is query position j0 + r / group of its chunk, head h * group + r % group; the softmax scale
 * (times FP8 K's scale) is folded into the fp32 queries. */
INLINE void load_queries(const PrefillArgs *a, const Task *t, Tile *w, const int64_t chunks, const int kv_dt,
                          const int q_dt) {
    const int64_t group = a->num_heads / a->num_kv_heads, dim = 16 * chunks, rows = t->rows * group;
    const float q_factor = a->scale * a->k_scale[t->h];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = a->rows[t->s] + t->j0 + r / group, head = t->h * group + r % group;
        const char *src = (const char *)a->query + (row * a->q_token_stride + head * dim) * elem_size(q_dt);
        for (int64_t d = 0; d < dim; d++) w->q[d * rows + r] = load_at(src, d, q_dt) * q_factor;
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
        memset(w->acc + r * dim, 0, sizeof(float) * dim);
    }
}

/* One task: its rows against every key tile any of them can see, then the normalized rows into `out`. */
INLINE void prefill_task(const PrefillArgs *a, const Task *t, Tile *w, const int64_t chunks, const int kv_dt,
                         const int q_dt) {
    const int64_t group = a->num_heads / a->num_kv_heads, dim = 16 * chunks, bs = a->block_size;
    const int64_t past = a->seq_lens[t->s] - a->query_lens[t->s], rows = t->rows * group;
    const int64_t first_pos = past + t->j0, end = first_pos + t->rows;  /* keys [first, end) */
    const int64_t first = a->window > 0 && first_pos >= a->window ? first_pos - a->window + 1 : 0;
    const int32_t *table = a->block_tables + t->s * a->block_table_stride;
    const size_t block_bytes = (size_t)bs * dim * elem_size(kv_dt);
    load_queries(a, t, w, chunks, kv_dt, q_dt);
    for (int64_t b = first / bs; b * bs < end; b++) {
        const size_t offset = (size_t)(t->h * a->num_blocks + table[b]) * block_bytes;
        const size_t row0 = (size_t)(t->h * a->num_blocks + table[b]) * bs;  /* int8: the block's first row scale */
        const _Float16 *krs = kv_dt == DT_I8 ? a->k_row_scale + row0 : NULL;
        const _Float16 *vrs = kv_dt == DT_I8 ? a->v_row_scale + row0 : NULL;
        const int64_t lo = b == first / bs ? (first - b * bs) / KT * KT : 0, hi = end - b * bs < bs ? end - b * bs : bs;
        for (int64_t i0 = lo; i0 < hi; i0 += KT) {
            const int64_t n = hi - i0 < KT ? hi - i0 : KT;
            load_k_tile((const char *)a->k_cache + offset, krs, i0, n, chunks, kv_dt, w);
            load_v_tile((const char *)a->v_cache + offset, vrs, i0, n, chunks, kv_dt, w->v);
            score_rows(w, rows, dim);
            for (int64_t r = 0; r < rows; r++)
                w->correction[r] = softmax_tile(w->p + r * KT, w->m + r, w->l + r, b * bs + i0, n,
                                                first_pos + r / group, a->window);
            accumulate_rows(w->acc, w->p, w->correction, rows, w->v, chunks);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = a->rows[t->s] + t->j0 + r / group, head = t->h * group + r % group;
        store_row(a->out, row * a->num_heads + head, dim, q_dt, w->acc + r * dim, a->v_scale[t->h] / w->l[r]);
    }
}

#define SPECIALIZE(D, KV, Q) \
    if (a->head_dim == D && a->kv_dtype == KV && a->q_dtype == Q) return prefill_task(a, t, w, D / 16, KV, Q)
#define SPECIALIZE_DIMS(KV, Q) SPECIALIZE(64, KV, Q); SPECIALIZE(128, KV, Q)

static void prefill_dispatch(const PrefillArgs *a, const Task *t, Tile *w) {
#if defined(PS_AMX)
    if (t->vt) return prefill_task_amx(a, t, w);
#endif
#if defined(PS_AVX512_BF16)
    if (PREFILL_DPBF16(a->kv_dtype, a->q_dtype)) return prefill_task_dpbf16(a, t, w);
#endif
    SPECIALIZE_DIMS(DT_BF16, DT_BF16);
    SPECIALIZE_DIMS(DT_F32, DT_F32);
    SPECIALIZE_DIMS(DT_F16, DT_F16);
    SPECIALIZE_DIMS(DT_E4M3, DT_BF16);
    SPECIALIZE_DIMS(DT_E5M2, DT_BF16);
    SPECIALIZE_DIMS(DT_I8, DT_BF16);
    SPECIALIZE_DIMS(DT_I8, DT_F32);
    prefill_task(a, t, w, a->head_dim / 16, a->kv_dtype, a->q_dtype);  /* the caller checked head_dim % 16 == 0 */
}

static int64_t task_keys(const PrefillArgs *a, const Task *t) {
    const int64_t end = a->seq_lens[t->s] - a->query_lens[t->s] + t->j0 + t->rows;
    return a->window > 0 && end - t->rows + 1 > a->window ? a->window + t->rows - 1 : end;
}

static const PrefillArgs *sort_args;  /* qsort has no context argument; set under the caller's single thread */

static int more_keys_first(const void *x, const void *y) {
    const int64_t kx = task_keys(sort_args, x), ky = task_keys(sort_args, y);
    return (kx < ky) - (kx > ky);
}

/* (chunk, KV head, 16 query positions) tasks, the longest first so that the last ones to start are short. */
static Task *make_tasks(const PrefillArgs *a, int64_t num_chunks, int64_t *count) {
    int64_t n = 0;
    for (int64_t s = 0; s < num_chunks; s++) n += (a->query_lens[s] + QT - 1) / QT * a->num_kv_heads;
    Task *tasks = malloc(sizeof(Task) * (size_t)(n ? n : 1));
    if (!tasks) return NULL;
    n = 0;
    for (int64_t s = 0; s < num_chunks; s++)
        for (int64_t j0 = 0; j0 < a->query_lens[s]; j0 += QT)
            for (int64_t h = 0; h < a->num_kv_heads; h++)
                tasks[n++] = (Task){s, h, j0, a->query_lens[s] - j0 < QT ? a->query_lens[s] - j0 : QT, NULL, 0};
    sort_args = a;
    qsort(tasks, (size_t)n, sizeof(Task), more_keys_first);
    *count = n;
    return tasks;
}

/* Every prefill chunk of a step in one call. Returns -1 when scratch memory could not be allocated. */
int pagedserve_prefill_attention(const PrefillArgs *a, int64_t num_chunks, int num_threads) {
    const int64_t rows = QT * (a->num_heads / a->num_kv_heads), dim = a->head_dim;
    int64_t count = 0;
    Task *tasks = make_tasks(a, num_chunks, &count);
    if (!tasks) return -1;
    uint32_t *values = NULL;
#if defined(PS_AMX)
    if (PREFILL_DPBF16(a->kv_dtype, a->q_dtype) && pagedserve_prefill_amx(dim)) {
        values = prefill_values_amx(a, num_chunks, tasks, count, num_threads);
        if (!values) return free(tasks), -1;
    }
#endif
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        Tile w = {scratch(rows * dim), scratch(dim * KT), scratch(KT * dim), scratch(rows * 8 * KT),
                  scratch(rows), scratch(rows), scratch(rows), scratch(rows * dim)};
        failed = !w.q || !w.k || !w.v || !w.p || !w.m || !w.l || !w.correction || !w.acc;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < count; i++)
            if (!failed) prefill_dispatch(a, &tasks[i], &w);
        free(w.q); free(w.k); free(w.v); free(w.p); free(w.m); free(w.l); free(w.correction); free(w.acc);
    }
    free(tasks);
    free(values);
    return failed ? -1 : 0;
}
