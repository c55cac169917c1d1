/* Decode attention over the paged KV cache, for every decode row of a step in one call (built and called by
 * kernels/cpu_native.py).
 *
 * Why C: in eager torch, decode attention over a paged cache is a gather of every context block (index_select),
 * an upcast copy, two small batched matmuls and a softmax, each a separate pass over memory plus per-op dispatch;
 * at decode sizes that was ~27% of bf16 step time. Here each (sequence, KV head) task reads its blocks in place,
 * once for K and once for V, with the scores of the query heads that share the KV head kept in L1.
 *
 * Semantics are those of the torch implementation (kernels/torch_attention.py), which the tests compare against:
 * fp32 scores and softmax, FP8 K/V times their per-head scale, output rounded once to the query dtype.
 * A sliding window W starts each row's key loop at max(0, len - W): earlier blocks are never read (the block
 * manager may have freed them; their block-table entries are then -1).
 * Storage layout: the head-major [Hkv, num_blocks, block_size, D] tensors behind LayerKVCache's logical view.
 */
#include "cpu_decode_attention.h"


typedef struct { float *scores, *q, *acc, *row, *part; } Scratch;  /* one per thread */

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
    for (int64_t t = 0; t < len; t++) peak = scores[t] > peak ? scores[t] : peak;
    f32x16 sums = {0};
    int64_t t = 0;
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

/* One sequence's query heads that share KV head `h`: scores over its visible context, softmax, probs x V.
 * Always inlined into callers that pass a constant number of 16-lane chunks (head_dim / 16) and constant dtypes:
 * every row loop then has a constant trip count and no branches, and the V accumulators stay in registers. */
INLINE void decode_task(const DecodeArgs *a, int64_t s, int64_t h, Scratch *w, const int64_t chunks, const int kv_dt,
                        const int q_dt) {
    const int64_t group = a->num_heads / a->num_kv_heads, bs = a->block_size, dim = 16 * chunks;
    const int64_t len = a->seq_lens[s], first_head = a->rows[s] * a->num_heads + h * group;
    const int64_t first = first_key(a, len), keys = len - first, first_tile = first - first % bs;
    const char *query = (const char *)a->query + (a->rows[s] * a->q_token_stride + h * group * dim) * elem_size(q_dt);
    const int32_t *table = a->block_tables + s * a->block_table_stride;
    const size_t kv_row = (size_t)dim * elem_size(kv_dt);
    const float q_factor = a->scale * a->k_scale[h];  /* FP8 K's scale folded into the query once */
    f32x16 *q = (f32x16 *)w->q;
    for (int64_t i = 0; i < group * chunks; i++) q[i] = load16(query, i, q_dt) * q_factor;
    const size_t tile_bytes = (size_t)bs * kv_row;
    /* Scores are stored from the first visible key on: scores[g * keys + t - first]. */
    for (int64_t t0 = first_tile; t0 < len; t0 += bs) {
        const size_t offset = (size_t)(h * a->num_blocks + table[t0 / bs]) * tile_bytes;
        const char *tile = (const char *)a->k_cache + offset;
        const int64_t n = len - t0 < bs ? len - t0 : bs, lo = t0 < first ? first - t0 : 0;
        /* Blocks are scattered, so the hardware prefetcher stops at every tile boundary: ask for the next K tile
         * now, and for this V tile, which the probs x V loop below then finds in cache. */
        const char *next_k = t0 + bs < len ? (const char *)a->k_cache + (size_t)(h * a->num_blocks + table[t0 / bs + 1]) * tile_bytes : tile;
        f32x16 *part = (f32x16 *)w->part;  /* [group][16]: each key's dot products before their lane sums */
        for (int64_t i0 = lo; i0 < n; i0 += 16) {
            const int64_t m = n - i0 < 16 ? n - i0 : 16;
            for (int64_t i = i0; i < i0 + m; i++) {
                /* Spread over the key loop: a burst of 2 * tile_bytes / 64 prefetches would fill the miss buffers
                 * and stall on them. */
                for (size_t line = 0; line < kv_row; line += 64) {
                    __builtin_prefetch(next_k + i * kv_row + line);
                    __builtin_prefetch((const char *)a->v_cache + offset + i * kv_row + line);
                }
                f32x16 k[chunks];
                for (int64_t c = 0; c < chunks; c++) k[c] = load16(tile + i * kv_row, c, kv_dt);
                for (int64_t g = 0; g < group; g++) {
                    f32x16 dot = q[g * chunks] * k[0];
                    for (int64_t c = 1; c < chunks; c++) dot += q[g * chunks + c] * k[c];
                    part[g * 16 + i - i0] = dot;
                }
            }
            for (int64_t g = 0; g < group; g++) {
                for (int64_t i = m; i < 16; i++) part[g * 16 + i] = (f32x16){0};
                const f32x16 sums = hsum16x16(part + g * 16);
                memcpy(w->scores + g * keys + t0 + i0 - first, &sums, sizeof(float) * (size_t)m);
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *p = w->scores + g * keys;  /* p[t - first]: the score of key t */
        const float factor = a->v_scale[h] / softmax_numerators(p, keys);
        f32x16 acc[chunks];
        for (int64_t c = 0; c < chunks; c++) acc[c] = (f32x16){0};
        for (int64_t t0 = first_tile; t0 < len; t0 += bs) {
            const char *tile = (const char *)a->v_cache + (h * a->num_blocks + table[t0 / bs]) * bs * kv_row;
            const int64_t n = len - t0 < bs ? len - t0 : bs, lo = t0 < first ? first - t0 : 0;
            for (int64_t i = lo; i < n; i++)
                for (int64_t c = 0; c < chunks; c++) acc[c] += p[t0 + i - first] * load16(tile + i * kv_row, c, kv_dt);
        }
        store_row(a->out, first_head + g, dim, q_dt, (const float *)acc, factor);
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
 * multiples of 16 take the vector code with a runtime chunk count, the rest the scalar code. */
#define SPECIALIZE(D, KV, Q) \
    if (a->head_dim == D && a->kv_dtype == KV && a->q_dtype == Q) return decode_task(a, s, h, w, D / 16, KV, Q)
#define SPECIALIZE_DIMS(KV, Q) SPECIALIZE(64, KV, Q); SPECIALIZE(128, KV, Q)

static void decode_dispatch(const DecodeArgs *a, int64_t s, int64_t h, Scratch *w) {
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
    if (a->head_dim % 16 == 0) return decode_task(a, s, h, w, a->head_dim / 16, a->kv_dtype, a->q_dtype);
    decode_task_scalar(a, s, h, w);
}

/* Every decode row of a step (one new token per sequence) in one call; tasks are (sequence, KV head) pairs. */
int pagedserve_decode_attention(const DecodeArgs *a, int64_t num_seqs, int64_t max_seq_len, int num_threads) {
    const int64_t group = a->num_heads / a->num_kv_heads, tasks = num_seqs * a->num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        Scratch w = {
            scratch(group * (max_seq_len > 0 ? max_seq_len : 1)),
            scratch(group * a->head_dim),
            scratch(group * a->head_dim),
            scratch(a->head_dim),
            scratch(group * 16 * 16),
        };
        failed = !w.scores || !w.q || !w.acc || !w.row || !w.part;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++)
            if (!failed) decode_dispatch(a, task / a->num_kv_heads, task % a->num_kv_heads, &w);
        free(w.scores); free(w.q); free(w.acc); free(w.row); free(w.part);
    }
    return failed ? -1 : 0;
}
