/* Decode attention over the paged KV cache, for every decode row of a step in one call (built and called by
 * kernels/cpu_native.py).
 *
 * Why C: in eager torch, decode attention over a paged cache is a gather of every context block (index_select),
 * an upcast copy, two small batched matmuls and a softmax, each a separate pass over memory plus per-op dispatch;
 * at decode sizes that was ~27% of bf16 step time. Here each (span, KV head) task reads its blocks in place,
 * once for K and once for V, with the scores of the query heads that share the KV head kept in L1; a span is one
 * decode row, or consecutive rows over the same cached keys (a sequence's row and its speculative drafts).
 *
 * Semantics are those of the torch implementation (kernels/torch_attention.py), which the tests compare against:
 * fp32 scores and softmax, FP8 K/V times their per-head scale, output rounded once to the query dtype.
 * A sliding window W starts each row's keys at max(0, len - W), a span's at its earliest row's start: earlier
 * blocks are never read (the block manager may have freed them; their block-table entries are then -1).
 * Storage layout: the head-major [Hkv, num_blocks, block_size, D] tensors behind LayerKVCache's logical view.
 */
#include "cpu_decode_attention.h"


typedef struct { float *scores, *q, *acc, *row; } Scratch;  /* one per thread */

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

/* Softmax numerators in place (fp32, max subtracted); returns their sum. 16 lanes at a time (the scalar exp was
 * ~7% of a long-context decode step), the tail lane by lane. */
static float softmax_numerators(float *scores, int64_t len) {
    float peak = -INFINITY, sum = 0.0f;
    int64_t t = 0;
    if (len >= 16) {  /* lane-wise maxima, then the tail: a scalar scan was ~40% of this function */
        f32x16 peaks;
        memcpy(&peaks, scores, sizeof peaks);
        for (t = 16; t + 16 <= len; t += 16) {
            f32x16 v;
            memcpy(&v, scores + t, sizeof v);
            peaks = select16(v > peaks, v, peaks);
        }
        peak = hmax16(peaks);
    }
    for (; t < len; t++) peak = scores[t] > peak ? scores[t] : peak;
    f32x16 sums = {0};
    t = 0;
    for (; t + 16 <= len; t += 16) {
        f32x16 v;
        memcpy(&v, scores + t, sizeof v);
        v = exp16_nonpositive(v - peak);
        memcpy(scores + t, &v, sizeof v);
        sums += v;
    }
    for (; t < len; t++) sum += (scores[t] = exp_nonpositive(scores[t] - peak));
    return sum + hsum16(sums);
}

/* The first key a decode row of context length `len` sees. */
INLINE int64_t first_key(const DecodeArgs *a, int64_t len) {
    return a->window > 0 && len > a->window ? len - a->window : 0;
}

/* A run of consecutive decode rows that read the same cached keys: one sequence's row and its speculative draft
 * rows (each a row of its own, its context ending at its own position). One task per (span, KV head) reads each K
 * and V row once for all the span's queries instead of once per row: a speculating step's 1 + k rows then cost
 * about one row's cache reads. */
typedef struct { int64_t s, m; } Span;

#define SPAN_QUERIES 32  /* query vectors (rows x query heads per KV head) in one task: bounds the score buffer */

/* probs x V for `nq` consecutive queries (qq0..) of a span: each V row is loaded once for all of them. Every
 * query's sums run over the span's keys in order, with zero probabilities outside its own range, so its result is
 * bit-identical to the query computed alone (x + 0 * v == x). nq and chunks are constants after inlining. */
INLINE void span_values(const DecodeArgs *a, const Span *sp, int64_t h, const float *scores, const float *factor,
                        int64_t keys, int64_t lo, int64_t hi, int64_t qq0, const int nq, const int64_t chunks,
                        const int kv_dt, const int q_dt) {
    const int64_t group = a->num_heads / a->num_kv_heads, bs = a->block_size, dim = 16 * chunks;
    const size_t kv_row = (size_t)dim * elem_size(kv_dt);
    const int32_t *table = a->block_tables + sp->s * a->block_table_stride;
    f32x16 acc[nq][chunks];
    for (int b = 0; b < nq; b++)
        for (int64_t c = 0; c < chunks; c++) acc[b][c] = (f32x16){0};
    for (int64_t t0 = lo - lo % bs; t0 < hi; t0 += bs) {
        const char *tile = (const char *)a->v_cache + (h * a->num_blocks + table[t0 / bs]) * bs * kv_row;
        const int64_t n = hi - t0 < bs ? hi - t0 : bs, tlo = t0 < lo ? lo - t0 : 0;
        for (int64_t i = tlo; i < n; i++) {
            f32x16 v[chunks];
            for (int64_t c = 0; c < chunks; c++) v[c] = load16(tile + i * kv_row, c, kv_dt);
            for (int b = 0; b < nq; b++) {
                const float pb = scores[(qq0 + b) * keys + t0 + i - lo];
                for (int64_t c = 0; c < chunks; c++) acc[b][c] += pb * v[c];
            }
        }
    }
    for (int b = 0; b < nq; b++) {
        const int64_t qq = qq0 + b, row = a->rows[sp->s + qq / group];
        store_row(a->out, row * a->num_heads + h * group + qq % group, dim, q_dt, (const float *)acc[b], factor[qq]);
    }
}

/* A span's queries that share KV head `h`: scores over the keys any of them sees, each query's softmax over its own
 * visible keys, probs x V. Always inlined into callers that pass a constant number of 16-lane chunks
 * (head_dim / 16) and constant dtypes: the row loops then have constant trip counts and the accumulators stay in
 * registers. */
INLINE void decode_task(const DecodeArgs *a, const Span *sp, int64_t h, Scratch *w, const int64_t chunks,
                        const int kv_dt, const int q_dt) {
    const int64_t group = a->num_heads / a->num_kv_heads, bs = a->block_size, dim = 16 * chunks, nq = sp->m * group;
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t i = 0; i < sp->m; i++) {
        const int64_t len = a->seq_lens[sp->s + i], first = first_key(a, len);
        lo = first < lo ? first : lo;
        hi = len > hi ? len : hi;
    }
    const int64_t keys = hi - lo, first_tile = lo - lo % bs;
    const int32_t *table = a->block_tables + sp->s * a->block_table_stride;
    const size_t kv_row = (size_t)dim * elem_size(kv_dt);
    const float q_factor = a->scale * a->k_scale[h];  /* FP8 K's scale folded into the query once */
    f32x16 *q = (f32x16 *)w->q;  /* [nq][chunks]: query qq = row qq / group of the span, head h * group + qq % group */
    for (int64_t i = 0; i < sp->m; i++) {
        const char *query = (const char *)a->query +
                            (a->rows[sp->s + i] * a->q_token_stride + h * group * dim) * elem_size(q_dt);
        for (int64_t j = 0; j < group * chunks; j++) q[i * group * chunks + j] = load16(query, j, q_dt) * q_factor;
    }
    const size_t tile_bytes = (size_t)bs * kv_row;
    /* Scores are stored from the span's first key on: scores[qq * keys + t - lo]. */
    for (int64_t t0 = first_tile; t0 < hi; t0 += bs) {
        const size_t offset = (size_t)(h * a->num_blocks + table[t0 / bs]) * tile_bytes;
        const char *tile = (const char *)a->k_cache + offset;
        const int64_t n = hi - t0 < bs ? hi - t0 : bs, tlo = t0 < lo ? lo - t0 : 0;
        /* Blocks are scattered, so the hardware prefetcher stops at every tile boundary: ask for the next K tile
         * now, and for this V tile, which the probs x V loop below then finds in cache. */
        const char *next_k = t0 + bs < hi ? (const char *)a->k_cache + (size_t)(h * a->num_blocks + table[t0 / bs + 1]) * tile_bytes : tile;
        for (int64_t i0 = tlo; i0 < n; i0 += 16) {
            const int64_t m = n - i0 < 16 ? n - i0 : 16;
            /* 16 keys widened to fp32 once for all the span's queries; each query's 16 dot vectors then stay in
             * registers up to their lane sums (a [query][key] buffer of them cost a store and a load each) */
            f32x16 kf[16][chunks];
            for (int64_t i = 0; i < 16; i++) {
                if (i >= m) {
                    for (int64_t c = 0; c < chunks; c++) kf[i][c] = (f32x16){0};
                    continue;
                }
                /* Spread over the key loop: a burst of 2 * tile_bytes / 64 prefetches would fill the miss buffers
                 * and stall on them. */
                for (size_t line = 0; line < kv_row; line += 64) {
                    __builtin_prefetch(next_k + (i0 + i) * kv_row + line);
                    __builtin_prefetch((const char *)a->v_cache + offset + (i0 + i) * kv_row + line);
                }
                for (int64_t c = 0; c < chunks; c++) kf[i][c] = load16(tile + (i0 + i) * kv_row, c, kv_dt);
            }
            for (int64_t qq = 0; qq < nq; qq++) {
                f32x16 dots[16];
                for (int64_t i = 0; i < 16; i++) {
                    f32x16 dot = q[qq * chunks] * kf[i][0];
                    for (int64_t c = 1; c < chunks; c++) dot += q[qq * chunks + c] * kf[i][c];
                    dots[i] = dot;
                }
                const f32x16 sums = hsum16x16(dots);
                float *dst = w->scores + qq * keys + t0 + i0 - lo;
                /* a constant size is one store; a variable one became `rep movsq` (~10% of the kernel) */
                if (m == 16) memcpy(dst, &sums, sizeof sums);
                else memcpy(dst, &sums, sizeof(float) * (size_t)m);
            }
        }
    }
    float factor[nq];
    for (int64_t qq = 0; qq < nq; qq++) {
        const int64_t len = a->seq_lens[sp->s + qq / group], first = first_key(a, len);
        float *p = w->scores + qq * keys;  /* p[t - lo]: the score of key t */
        factor[qq] = a->v_scale[h] / softmax_numerators(p + first - lo, len - first);
        memset(p, 0, sizeof(float) * (size_t)(first - lo));  /* keys this query does not see weigh nothing */
        memset(p + len - lo, 0, sizeof(float) * (size_t)(hi - len));
    }
    /* Up to 4 queries per pass over V (2 at head_dim 128: 16 accumulators and the V row stay in registers). */
    const int most = chunks <= 4 ? 4 : 2;
    for (int64_t qq0 = 0; qq0 < nq;) {
        const int64_t left = nq - qq0, take = left < most ? left : most;
        if (take == 4) span_values(a, sp, h, w->scores, factor, keys, lo, hi, qq0, 4, chunks, kv_dt, q_dt);
        else if (take == 3) span_values(a, sp, h, w->scores, factor, keys, lo, hi, qq0, 3, chunks, kv_dt, q_dt);
        else if (take == 2) span_values(a, sp, h, w->scores, factor, keys, lo, hi, qq0, 2, chunks, kv_dt, q_dt);
        else span_values(a, sp, h, w->scores, factor, keys, lo, hi, qq0, 1, chunks, kv_dt, q_dt);
        qq0 += take;
    }
}

/* head_dim not a multiple of 16: the same algorithm, one lane at a time. */
static void decode_task_scalar(const DecodeArgs *a, int64_t s, int64_t h, Scratch *w) {
    const int64_t group = a->num_heads / a->num_kv_heads, bs = a->block_size, dim = a->head_dim;
    const int64_t len = a->seq_lens[s], first_head = a->rows[s] * a->num_heads + h * group;
    const int64_t first = first_key(a, len), keys = len - first;
    const void *query = (const char *)a->query + a->rows[s] * a->q_token_stride * elem_size(a->q_dtype);
    const int32_t *table = a->block_tables + s * a->block_table_stride;
    const float q_factor = a->scale * a->k_scale[h];
    for (int64_t g = 0; g < group; g++) {
        const float *q = row_f32(query, h * group + g, dim, a->q_dtype, w->row);
        for (int64_t d = 0; d < dim; d++) w->q[g * dim + d] = q[d] * q_factor;
    }
    for (int64_t t = first; t < len; t++) {
        const float *k = row_f32(a->k_cache, (h * a->num_blocks + table[t / bs]) * bs + t % bs, dim, a->kv_dtype, w->row);
        for (int64_t g = 0; g < group; g++) {
            float dot = 0.0f;
            for (int64_t d = 0; d < dim; d++) dot += w->q[g * dim + d] * k[d];
            w->scores[g * keys + t - first] = dot;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float factor = a->v_scale[h] / softmax_numerators(w->scores + g * keys, keys);
        float *acc = w->acc;
        memset(acc, 0, sizeof(float) * dim);
        for (int64_t t = first; t < len; t++) {
            const float *v = row_f32(a->v_cache, (h * a->num_blocks + table[t / bs]) * bs + t % bs, dim, a->kv_dtype, w->row);
            for (int64_t d = 0; d < dim; d++) acc[d] += w->scores[g * keys + t - first] * v[d];
        }
        store_row(a->out, first_head + g, dim, a->q_dtype, acc, factor);
    }
}

/* The specializations: every (KV dtype, query dtype) pair the engine makes, at head_dim 64 and 128; other
 * multiples of 16 take the vector code with a runtime chunk count, the rest the scalar code, row by row. */
#define SPECIALIZE(D, KV, Q) \
    if (a->head_dim == D && a->kv_dtype == KV && a->q_dtype == Q) return decode_task(a, sp, h, w, D / 16, KV, Q)
#define SPECIALIZE_DIMS(KV, Q) SPECIALIZE(64, KV, Q); SPECIALIZE(128, KV, Q)

static void decode_dispatch(const DecodeArgs *a, const Span *sp, int64_t h, Scratch *w) {
    SPECIALIZE_DIMS(DT_BF16, DT_BF16);
    SPECIALIZE_DIMS(DT_F32, DT_F32);
    SPECIALIZE_DIMS(DT_F16, DT_F16);
    SPECIALIZE_DIMS(DT_E4M3, DT_BF16);
    SPECIALIZE_DIMS(DT_E5M2, DT_BF16);
    /* fp32 queries over 16-bit and FP8 caches: the native decode step (cpu_decode_step.c) keeps its state fp32 */
    SPECIALIZE_DIMS(DT_BF16, DT_F32);
    SPECIALIZE_DIMS(DT_F16, DT_F32);
    SPECIALIZE_DIMS(DT_E4M3, DT_F32);
    SPECIALIZE_DIMS(DT_E5M2, DT_F32);
    if (a->head_dim % 16 == 0) return decode_task(a, sp, h, w, a->head_dim / 16, a->kv_dtype, a->q_dtype);
    for (int64_t i = 0; i < sp->m; i++) decode_task_scalar(a, sp->s + i, h, w);
}

/* Whether decode row s may join `span` (which ends at row s - 1): its context is no shorter than row s - 1's and its
 * block-table entries equal the span's over all of it (so every row of the span reads the same cached keys; a
 * draft row and the row before it always do). The span's queries are bounded by SPAN_QUERIES. */
static int joins_span(const DecodeArgs *a, const Span *span, int64_t s) {
    const int64_t group = a->num_heads / a->num_kv_heads, len = a->seq_lens[s];
    if ((span->m + 1) * group > SPAN_QUERIES || len < a->seq_lens[s - 1]) return 0;
    const int32_t *first = a->block_tables + span->s * a->block_table_stride;
    const int32_t *next = a->block_tables + s * a->block_table_stride;
    return memcmp(first, next, sizeof(int32_t) * (size_t)((len + a->block_size - 1) / a->block_size)) == 0;
}

/* Splits the decode rows into spans; returns their count. */
static int64_t find_spans(const DecodeArgs *a, int64_t num_seqs, Span *spans) {
    int64_t count = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (count && joins_span(a, &spans[count - 1], s)) spans[count - 1].m++;
        else spans[count++] = (Span){s, 1};
    }
    return count;
}

/* Every decode row of a step (one new token per sequence, or a sequence's row and its drafts) in one call; tasks
 * are (span, KV head) pairs. */
int pagedserve_decode_attention(const DecodeArgs *a, int64_t num_seqs, int64_t max_seq_len, int num_threads) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    Span *spans = malloc(sizeof(Span) * (size_t)(num_seqs > 0 ? num_seqs : 1));
    if (!spans) return -1;
    const int64_t num_spans = find_spans(a, num_seqs, spans), tasks = num_spans * a->num_kv_heads;
    int64_t most_rows = 1;
    for (int64_t i = 0; i < num_spans; i++) most_rows = spans[i].m > most_rows ? spans[i].m : most_rows;
    const int64_t queries = most_rows * group, keys = max_seq_len > 0 ? max_seq_len : 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        Scratch w = {
            scratch(queries * keys),
            scratch(queries * a->head_dim),
            scratch(group * a->head_dim),
            scratch(a->head_dim),
        };
        failed = !w.scores || !w.q || !w.acc || !w.row;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++)
            if (!failed) decode_dispatch(a, &spans[task / a->num_kv_heads], task % a->num_kv_heads, &w);
        free(w.scores); free(w.q); free(w.acc); free(w.row);
    }
    free(spans);
    return failed ? -1 : 0;
}
