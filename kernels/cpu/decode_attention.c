/* Decode attention over the paged KV cache: the math of one task, a span's queries that share a KV head over one
 * chunk of their keys (scheduled by decode_tasks.c; built and called by kernels/cpu/native.py).
 *
 * Why C: in eager torch, decode attention over a paged cache is a gather of every context block (index_select),
 * an upcast copy, two small batched matmuls and a softmax, each a separate pass over memory plus per-op dispatch;
 * at decode sizes that was ~27% of bf16 step time. Here a task reads its blocks in place, once for K and once for
 * V, with the scores of the query heads that share the KV head kept in L1; a span is one decode row, or
 * consecutive rows over the same cached keys (a sequence's row and its speculative drafts).
 *
 * Semantics are those of the torch implementation (kernels/torch_attention.py), which the tests compare against:
 * fp32 scores and softmax, FP8 K/V times their per-head scale, output rounded once to the query dtype. The softmax
 * runs per chunk of keys and the chunks merge flash-decoding style (decode_chunks.h).
 * A sliding window W starts each row's keys at max(0, len - W), a span's at its earliest row's start: earlier
 * blocks are never read (the block manager may have freed them; their block-table entries are then -1).
 * Storage layout: the head-major [Hkv, num_blocks, block_size, D] tensors behind LayerKVCache's logical view.
 */
/* RTL GCSE (PRE and load CSE after reload) spends ~100 of gcc 12's 118 s on this file at -O3 (-ftime-report, AVX2
 * tier), once per tier on every cold build, CI's included; without it the file compiles in ~12 s, and the kernel's
 * time is unchanged within noise (benchmarks/decode_attention_ab.py against the file without this line: 0.99-1.03x,
 * bf16 and int8 caches; benchmarks/results/2026-11-28-spr-decode-attention-no-gcse-ab-*-quiet.json). */
#pragma GCC optimize("no-gcse", "no-gcse-after-reload")
#include "isa.h"
#include "decode_chunks.h"
#include "decode_scores.h"
#include "kv_values.h"

/* Softmax numerators in place (fp32, max subtracted); returns their sum, and the max in *peak_out. 16 lanes at a
 * time (the scalar exp was ~7% of a long-context decode step), the tail lane by lane. */
static float softmax_numerators(float *scores, int64_t len, float *peak_out) {
    float peak = -INFINITY, sum = 0.0f;
    int64_t t = 0;
    if (len >= 16) {  /* lane-wise maxima, then the tail: a scalar scan was ~40% of this function */
        peak = hmax16(max16_scan(scores, len / 16));
        t = len - len % 16;
    }
    for (; t < len; t++) peak = scores[t] > peak ? scores[t] : peak;
    f32x16 sums = {0};
    t = 0;
#if defined(PS_AVX2_ONLY)
    /* the same lanes' operations and sums in 8-lane halves: the 16-lane loop moved every numerator and running sum
     * through the stack and general registers on this target (~6% of an AVX2 decode step at 4k keys) */
    f32x8 half_sums[2] = {{0}, {0}};
    for (; t + 16 <= len; t += 16)
        for (int h = 0; h < 2; h++) {
            f32x8 v;
            memcpy(&v, scores + t + 8 * h, sizeof v);
            v = exp8_nonpositive(v - peak);
            memcpy(scores + t + 8 * h, &v, sizeof v);
            half_sums[h] += v;
        }
    memcpy(&sums, half_sums, sizeof sums);
#else
    for (; t + 16 <= len; t += 16) {
        f32x16 v;
        memcpy(&v, scores + t, sizeof v);
        v = exp16_nonpositive(v - peak);
        memcpy(scores + t, &v, sizeof v);
        sums += v;
    }
#endif
    for (; t < len; t++) sum += (scores[t] = exp_nonpositive(scores[t] - peak));
    *peak_out = peak;
    return sum + hsum16(sums);
}

/* The first key a decode row of context length `len` sees. */
INLINE int64_t first_key(const DecodeArgs *a, int64_t len) {
    return a->window > 0 && len > a->window ? len - a->window : 0;
}

void span_keys(const DecodeArgs *a, const Span *sp, int64_t *lo, int64_t *hi) {
    *lo = INT64_MAX, *hi = 0;
    for (int64_t i = 0; i < sp->m; i++) {
        const int64_t len = a->seq_lens[sp->s + i], first = first_key(a, len);
        *lo = first < *lo ? first : *lo;
        *hi = len > *hi ? len : *hi;
    }
}

/* Each query's softmax numerators over its own keys within the chunk, the chunk's other keys zeroed; its max and
 * sum go to its partial (sum 0: it sees none of the chunk's keys). */
static void chunk_softmax(const DecodeArgs *a, const Span *sp, const Keys *k, float *scores, float *part,
                          int64_t dim) {
    const int64_t group = a->num_heads / a->num_kv_heads, stride = partial_stride(dim);
    for (int64_t qq = 0; qq < sp->m * group; qq++) {
        const int64_t len = a->seq_lens[sp->s + qq / group], first = first_key(a, len);
        const int64_t from = first > k->k0 ? first : k->k0, to = len < k->k1 ? len : k->k1;
        float *p = scores + qq * KEY_CHUNK, *stats = part + qq * stride + dim;  /* p[t - k0]: the score of key t */
        if (from >= to) {
            memset(p, 0, sizeof(float) * (size_t)(k->k1 - k->k0));
            stats[0] = -INFINITY, stats[1] = 0.0f;
            continue;
        }
        stats[1] = softmax_numerators(p + from - k->k0, to - from, &stats[0]);
        memset(p, 0, sizeof(float) * (size_t)(from - k->k0));  /* keys this query does not see weigh nothing */
        memset(p + to - k->k0, 0, sizeof(float) * (size_t)(k->k1 - to));
    }
}

/* int8 V: each key's softmax numerator times its V row's scale (after the sums went to the partials), so that the
 * probs x V loop reads V rows as stored instead of scaling every row (a multiply per 16 lanes and a scalar
 * fp16 load per row). 16 keys at a time where a tile has them. */
INLINE void scale_probs(const DecodeArgs *a, const Keys *k, int64_t h, float *scores, int64_t nq) {
    const int64_t bs = a->block_size;
    for (int64_t t0 = k->k0 - k->k0 % bs; t0 < k->k1; t0 += bs) {
        const _Float16 *rs = a->v_row_scale + (h * a->num_blocks + k->table[t0 / bs]) * bs;
        const int64_t n = k->k1 - t0 < bs ? k->k1 - t0 : bs, tlo = t0 < k->k0 ? k->k0 - t0 : 0;
        int64_t i = tlo;
        for (; i + 16 <= n; i += 16) {
            const f32x16 r = row_scales16(rs + i, 16);
            for (int64_t qq = 0; qq < nq; qq++) {
                float *p = scores + qq * KEY_CHUNK + t0 + i - k->k0;
                f32x16 v;
                memcpy(&v, p, sizeof v);
                v *= r;
                memcpy(p, &v, sizeof v);
            }
        }
        for (; i < n; i++)
            for (int64_t qq = 0; qq < nq; qq++) scores[qq * KEY_CHUNK + t0 + i - k->k0] *= (float)rs[i];
    }
}

/* One chunk of a span's queries that share KV head `h`. Always inlined into callers that pass a constant number of
 * 16-lane chunks (head_dim / 16) and constant dtypes: the row loops then have constant trip counts and the
 * accumulators stay in registers. */
INLINE void chunk_task(const DecodeArgs *a, const Span *sp, int64_t h, int64_t c, Scratch *w, float *part,
                       const int64_t chunks, const int kv_dt, const int q_dt) {
    const int64_t group = a->num_heads / a->num_kv_heads, dim = 16 * chunks, nq = sp->m * group;
    int64_t lo, hi;
    span_keys(a, sp, &lo, &hi);
    const Keys k = {lo > c * KEY_CHUNK ? lo : c * KEY_CHUNK, hi < (c + 1) * KEY_CHUNK ? hi : (c + 1) * KEY_CHUNK, hi,
                    a->block_tables + sp->s * a->block_table_stride};
    /* FP8 K's scale (and kv_row16's power of two) folded into the query once */
    const float q_factor = a->scale * a->k_scale[h] * kv_row16_factor(kv_dt);
    f32x16 *q = (f32x16 *)w->q;  /* [nq][chunks]: query qq = row qq / group of the span, head h * group + qq % group */
    for (int64_t i = 0; i < sp->m; i++) {
        const char *query = (const char *)a->query +
                            (a->rows[sp->s + i] * a->q_token_stride + h * group * dim) * elem_size(q_dt);
        for (int64_t j = 0; j < group * chunks; j++) q[i * group * chunks + j] = load16(query, j, q_dt) * q_factor;
    }
    /* int8 K: the queries as int16 (each chunk twice) and their scales, after the fp32 ones (thread_scratch leaves
     * room) */
    i16x32 *q16 = (i16x32 *)(q + nq * chunks);
    float *qs = (float *)(q16 + nq * chunks);
    if (kv_dt == DT_I8)
        for (int64_t qq = 0; qq < nq; qq++) qs[qq] = kv_dot_quantize(q + qq * chunks, chunks, q16 + qq * chunks);
    chunk_scores(a, &k, h, q, q16, qs, nq, w->scores, chunks, kv_dt);
    chunk_softmax(a, sp, &k, w->scores, part, dim);
    float ps[nq];  /* int8 V: each query's probabilities as int16 in place of its scores, and their scale */
    if (kv_dt == DT_I8) {
        scale_probs(a, &k, h, w->scores, nq);
        for (int64_t qq = 0; qq < nq; qq++) ps[qq] = values_quantize(w->scores + qq * KEY_CHUNK, k.k1 - k.k0, k.k0 % 2);
    }
    /* Up to 4 queries per pass over V (2 at head_dim 128: 16 accumulators and the V row stay in registers; 4 at
     * every head_dim on AVX2, whose passes take 16 dims at a time). */
    const int most = chunks <= 4 || VALUES_BY_CHUNK ? 4 : 2;
    for (int64_t qq0 = 0; qq0 < nq;) {
        const int64_t left = nq - qq0, take = left < most ? left : most;
        if (kv_dt == DT_I8) {
            if (take == 4) values_i8(a, &k, h, w->scores, ps, part, qq0, 4, chunks);
            else if (take == 3) values_i8(a, &k, h, w->scores, ps, part, qq0, 3, chunks);
            else if (take == 2) values_i8(a, &k, h, w->scores, ps, part, qq0, 2, chunks);
            else values_i8(a, &k, h, w->scores, ps, part, qq0, 1, chunks);
        } else if (take == 4) chunk_values(a, &k, h, w->scores, part, qq0, 4, chunks, kv_dt);
        else if (take == 3) chunk_values(a, &k, h, w->scores, part, qq0, 3, chunks, kv_dt);
        else if (take == 2) chunk_values(a, &k, h, w->scores, part, qq0, 2, chunks, kv_dt);
        else chunk_values(a, &k, h, w->scores, part, qq0, 1, chunks, kv_dt);
        qq0 += take;
    }
}

/* head_dim not a multiple of 16: one row at a time over all its keys, one lane at a time, straight to the output. */
static void row_scalar(const DecodeArgs *a, int64_t s, int64_t h, Scratch *w) {
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
        const int64_t slot = (h * a->num_blocks + table[t / bs]) * bs + t % bs;
        const float *k = row_f32(a->k_cache, slot, dim, a->kv_dtype, w->row);
        const float row_scale = a->kv_dtype == DT_I8 ? (float)a->k_row_scale[slot] : 1.0f;
        for (int64_t g = 0; g < group; g++) {
            float dot = 0.0f;
            for (int64_t d = 0; d < dim; d++) dot += w->q[g * dim + d] * k[d];
            w->scores[g * keys + t - first] = dot * row_scale;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float peak;
        const float factor = a->v_scale[h] / softmax_numerators(w->scores + g * keys, keys, &peak);
        float *acc = w->acc;
        memset(acc, 0, sizeof(float) * dim);
        for (int64_t t = first; t < len; t++) {
            const int64_t slot = (h * a->num_blocks + table[t / bs]) * bs + t % bs;
            const float *v = row_f32(a->v_cache, slot, dim, a->kv_dtype, w->row);
            const float p = w->scores[g * keys + t - first] * (a->kv_dtype == DT_I8 ? (float)a->v_row_scale[slot] : 1.0f);
            for (int64_t d = 0; d < dim; d++) acc[d] += p * v[d];
        }
        store_row(a->out, first_head + g, dim, a->q_dtype, acc, factor);
    }
}

void decode_rows_scalar(const DecodeArgs *a, const Span *sp, int64_t h, Scratch *w) {
    for (int64_t i = 0; i < sp->m; i++) row_scalar(a, sp->s + i, h, w);
}

/* The specializations: every (KV dtype, query dtype) pair the engine makes, at head_dim 64 and 128; other
 * multiples of 16 take the vector code with a runtime chunk count. The portable build (SSE2, no F16C) keeps only the
 * default bf16 cache's two: all of them took its compile from 15 to 63 s, paid on every cold build (CI's included),
 * for no measured gain there (benchmarks/decode_attention_ab.py, portable tier: bf16 and int8 caches 1.0-1.15x
 * faster without the rest; benchmarks/results/2026-12-06-xeon-model207-decode-attention-portable-*). */
#define SPECIALIZE(D, KV, Q) \
    if (a->head_dim == D && a->kv_dtype == KV && a->q_dtype == Q) return chunk_task(a, sp, h, c, w, part, D / 16, KV, Q)
#define SPECIALIZE_DIMS(KV, Q) SPECIALIZE(64, KV, Q); SPECIALIZE(128, KV, Q)

void decode_chunk(const DecodeArgs *a, const Span *sp, int64_t h, int64_t c, Scratch *w, float *part) {
    SPECIALIZE_DIMS(DT_BF16, DT_BF16);
#if defined(PS_AVX2)
    SPECIALIZE_DIMS(DT_F32, DT_F32);
    SPECIALIZE_DIMS(DT_F16, DT_F16);
    SPECIALIZE_DIMS(DT_E4M3, DT_BF16);
    SPECIALIZE_DIMS(DT_E5M2, DT_BF16);
#endif
    /* fp32 queries over 16-bit and FP8 caches: the native decode step (decode_step.c) keeps its state fp32 */
    SPECIALIZE_DIMS(DT_BF16, DT_F32);
#if defined(PS_AVX2)
    SPECIALIZE_DIMS(DT_F16, DT_F32);
    SPECIALIZE_DIMS(DT_E4M3, DT_F32);
    SPECIALIZE_DIMS(DT_E5M2, DT_F32);
    SPECIALIZE_DIMS(DT_I8, DT_BF16);
    SPECIALIZE_DIMS(DT_I8, DT_F32);
    SPECIALIZE_DIMS(DT_I8, DT_F16);
#endif
    chunk_task(a, sp, h, c, w, part, a->head_dim / 16, a->kv_dtype, a->q_dtype);
}

PS_SIZEOF(decode_args, DecodeArgs)
