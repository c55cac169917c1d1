/* Decode attention's entry point: every decode row of a step in one call, split into OpenMP tasks, the partials of
 * key chunks merged (the per-chunk math: decode_attention.c; the chunks: decode_chunks.h).
 *
 * Tasks are (span, KV head) pairs, each running its chunks in order and merging as it goes. When there are few
 * pairs per thread (one stream: a model's 1-3 KV heads for 2+ threads) each pair is cut into pieces of consecutive
 * chunks, about SPLIT_BELOW tasks per thread, that keep their chunks' partials, and whichever thread finishes a
 * pair's last piece merges them: the same merge, in the same order, so the bits do not change (and no thread waits at
 * a barrier for the merges).
 */
#include "isa.h"
#include <pthread.h>

#include "decode_chunks.h"
#include "kv_dot.h"

#ifndef SPLIT_BELOW
#define SPLIT_BELOW 4  /* split the pairs into chunk tasks when there are fewer than this many per thread */
#endif

/* A task: chunks [c0, c1) of a (span, KV head) pair. pair == NULL: the task merges them and stores the outputs.
 * Otherwise it is a piece of a split pair (a Task over all the pair's chunks, `left` of its pieces still running)
 * that keeps chunk c's partials at parts + (c - c0) * (the span's queries) * partial_stride. */
typedef struct Task { int64_t span, head, c0, c1; float *parts; struct Task *pair; int64_t left; } Task;

/* Buffers that outlive a call, per thread: the step calls this every layer, every few milliseconds. The caller's
 * plan (spans, tasks, partials) and each OpenMP thread's scratch; freed when the thread exits. */
enum { SPANS, TASKS, PARTS, SCRATCH, NUM_REUSED };
typedef struct { void *p; size_t bytes; } Reused;

static pthread_key_t reused_key[NUM_REUSED];
static pthread_once_t reused_once = PTHREAD_ONCE_INIT;

static void free_reused(void *r) {
    free(((Reused *)r)->p);
    free(r);
}

static void make_keys(void) {
    for (int i = 0; i < NUM_REUSED; i++) pthread_key_create(&reused_key[i], free_reused);
}

/* This thread's buffer `which`, 64-byte aligned, at least `bytes` long (contents not kept when it grows); NULL if
 * out of memory. */
static void *reused(int which, size_t bytes) {
    pthread_once(&reused_once, make_keys);
    Reused *r = pthread_getspecific(reused_key[which]);
    if (!r) {
        if (!(r = calloc(1, sizeof *r))) return NULL;
        if (pthread_setspecific(reused_key[which], r)) return free(r), NULL;
    }
    if (r->bytes < bytes) {
        free(r->p);
        r->p = aligned_alloc(64, (bytes + 63) / 64 * 64);
        r->bytes = r->p ? bytes : 0;
    }
    return r->p;
}

/* Folds one chunk's partials of `nq` queries into the running state (the first chunk's are copied). Not inlined:
 * a task that runs all its pair's chunks and the last chunk task of a split pair must run the very same
 * instructions. */
__attribute__((noinline)) static void merge_chunk(float *state, const float *part, int64_t nq, int64_t dim,
                                                  int first) {
    const int64_t stride = partial_stride(dim);
    for (int64_t qq = 0; qq < nq; qq++) {
        float *s = state + qq * stride;
        const float *p = part + qq * stride;
        if (first || s[dim + 1] == 0.0f) {  /* no keys seen yet (a later row of a span, or a window's start) */
            memcpy(s, p, sizeof(float) * (size_t)(dim + 2));
            continue;
        }
        if (p[dim + 1] == 0.0f) continue;  /* the chunk holds none of this query's keys */
        const float peak = s[dim] > p[dim] ? s[dim] : p[dim];
        const float fs = exp_nonpositive(s[dim] - peak), fp = exp_nonpositive(p[dim] - peak);
        for (int64_t d = 0; d < dim; d++) s[d] = s[d] * fs + p[d] * fp;
        s[dim] = peak, s[dim + 1] = s[dim + 1] * fs + p[dim + 1] * fp;
    }
}

/* The merged state of a span's queries that share KV head h, normalized and scaled, into their output rows. */
__attribute__((noinline)) static void store_outputs(const DecodeArgs *a, const Span *sp, int64_t h,
                                                    const float *state) {
    const int64_t group = a->num_heads / a->num_kv_heads, dim = a->head_dim, stride = partial_stride(dim);
    for (int64_t qq = 0; qq < sp->m * group; qq++) {
        const float *s = state + qq * stride;
        const int64_t row = a->rows[sp->s + qq / group];
        store_row(a->out, row * a->num_heads + h * group + qq % group, dim, a->q_dtype, s,
                  a->v_scale[h] * kv_row16_factor(a->kv_dtype) / s[dim + 1]);  /* FP8 V: kv_row16 */
    }
}

/* A split pair's chunk partials (`pair`: all its chunks, parts their first), merged in order, into its outputs. */
static void merge_pair(const DecodeArgs *a, const Span *spans, const Task *pair, Scratch *w) {
    const Span *sp = &spans[pair->span];
    const int64_t nq = sp->m * (a->num_heads / a->num_kv_heads), size = nq * partial_stride(a->head_dim);
    for (int64_t c = pair->c0; c < pair->c1; c++)
        merge_chunk(w->state, pair->parts + (c - pair->c0) * size, nq, a->head_dim, c == pair->c0);
    store_outputs(a, sp, pair->head, w->state);
}

static void run_task(const DecodeArgs *a, const Span *spans, Task *t, Scratch *w) {
    const Span *sp = &spans[t->span];
    if (a->head_dim % 16) return decode_rows_scalar(a, sp, t->head, w);
    const int64_t nq = sp->m * (a->num_heads / a->num_kv_heads);
    if (t->pair) {
        const int64_t size = nq * partial_stride(a->head_dim);
        for (int64_t c = t->c0; c < t->c1; c++) decode_chunk(a, sp, t->head, c, w, t->parts + (c - t->c0) * size);
        /* acq_rel: the last one sees every other task's partials */
        if (__atomic_sub_fetch(&t->pair->left, 1, __ATOMIC_ACQ_REL) == 0) merge_pair(a, spans, t->pair, w);
        return;
    }
    for (int64_t c = t->c0; c < t->c1; c++) {
        decode_chunk(a, sp, t->head, c, w, w->part);
        merge_chunk(w->state, w->part, nq, a->head_dim, c == t->c0);
    }
    store_outputs(a, sp, t->head, w->state);
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

/* One stream's row and drafts make one span over a model's few KV heads: fewer pairs than threads balance (3 heads
 * on 2 threads leave one thread idle a third of the attention), and cutting its keys into chunk pieces balances only
 * contexts of several chunks. So while there are fewer than SPLIT_BELOW pairs per thread, spans of several rows are
 * cut into spans of consecutive rows, as equal as they come: a row's result does not depend on the rows beside it,
 * so the bits do not change, and each part rereads the span's keys from cache. Returns the new span count. */
static int64_t split_spans(const DecodeArgs *a, Span *spans, int64_t count, int num_threads) {
    const int64_t want = (SPLIT_BELOW * num_threads + a->num_kv_heads - 1) / a->num_kv_heads;
    if (num_threads < 2 || count >= want) return count;
    const int64_t parts = (want + count - 1) / count;
    int64_t total = 0;
    for (int64_t i = 0; i < count; i++) total += spans[i].m < parts ? spans[i].m : parts;
    /* from the last span down, so every span is read before its slots are overwritten */
    for (int64_t i = count - 1, at = total; i >= 0; i--) {
        const Span sp = spans[i];
        const int64_t g = sp.m < parts ? sp.m : parts;
        for (int64_t j = g - 1; j >= 0; j--) {
            const int64_t from = j * sp.m / g, to = (j + 1) * sp.m / g;
            spans[--at] = (Span){sp.s + from, to - from};
        }
    }
    return total;
}

/* The chunks a span's keys touch: [*c0, *c1); one pseudo-chunk for the scalar code, which does not chunk. */
static void span_chunks(const DecodeArgs *a, const Span *sp, int64_t *c0, int64_t *c1) {
    int64_t lo, hi;
    span_keys(a, sp, &lo, &hi);
    *c0 = a->head_dim % 16 ? 0 : lo / KEY_CHUNK;
    *c1 = a->head_dim % 16 || hi <= lo ? *c0 + 1 : (hi - 1) / KEY_CHUNK + 1;
}

typedef struct { Task *tasks, *pairs; int64_t num_tasks, num_pairs; } Plan;  /* pairs: the split ones */

/* One task per (span, KV head) pair; with `pieces`, every pair with several chunks is split into that many tasks
 * of consecutive chunks (or one per chunk if it has fewer). */
static int make_plan(const DecodeArgs *a, const Span *spans, int64_t num_spans, int64_t pieces, Plan *plan) {
    int64_t tasks = 0, floats = 0, pairs = 0;
    const int64_t group = a->num_heads / a->num_kv_heads, stride = partial_stride(a->head_dim);
    for (int64_t i = 0; i < num_spans; i++) {
        int64_t c0, c1;
        span_chunks(a, &spans[i], &c0, &c1);
        const int64_t n = pieces && c1 - c0 > 1 ? c1 - c0 : 1, g = n < pieces ? n : pieces;
        tasks += (n > 1 ? g : 1) * a->num_kv_heads;
        pairs += n > 1 ? a->num_kv_heads : 0;
        floats += n > 1 ? n * spans[i].m * group * stride * a->num_kv_heads : 0;
    }
    plan->tasks = reused(TASKS, sizeof(Task) * (size_t)(tasks + pairs));
    float *parts = floats ? reused(PARTS, sizeof(float) * (size_t)floats) : NULL;
    if (!plan->tasks || (floats && !parts)) return -1;
    plan->pairs = plan->tasks + tasks, plan->num_tasks = plan->num_pairs = 0;
    for (int64_t i = 0; i < num_spans; i++) {
        int64_t c0, c1;
        span_chunks(a, &spans[i], &c0, &c1);
        const int64_t size = spans[i].m * group * stride, n = c1 - c0, g = n < pieces ? n : pieces;
        for (int64_t h = 0; h < a->num_kv_heads; h++) {
            if (!pieces || n == 1) {
                plan->tasks[plan->num_tasks++] = (Task){i, h, c0, c1, NULL, NULL, 0};
                continue;
            }
            Task *pair = &plan->pairs[plan->num_pairs++];
            *pair = (Task){i, h, c0, c1, parts, NULL, g};
            for (int64_t j = 0; j < g; j++) {
                const int64_t from = c0 + j * n / g, to = c0 + (j + 1) * n / g;
                plan->tasks[plan->num_tasks++] = (Task){i, h, from, to, parts + (from - c0) * size, pair, 0};
            }
            parts += n * size;
        }
    }
    return 0;
}

/* This thread's scratch, carved from one reused buffer: `queries` is the most queries of a span. */
static int thread_scratch(const DecodeArgs *a, int64_t queries, int64_t max_seq_len, Scratch *w) {
    const int64_t dim = a->head_dim, group = a->num_heads / a->num_kv_heads;
    const int64_t scores = dim % 16 ? group * (max_seq_len > 0 ? max_seq_len : 1) : queries * KEY_CHUNK;
    /* queries: fp32, then for int8 K as int16 (each 16-lane chunk twice: dim floats' bytes) and their scales
     * (decode_attention.c) */
    const int64_t sizes[6] = {queries * (2 * dim + 16), scores, queries * partial_stride(dim), queries * partial_stride(dim),
                              dim, dim};
    int64_t total = 0;
    for (int i = 0; i < 6; i++) total += (sizes[i] + 15) / 16 * 16;
    float *p = reused(SCRATCH, sizeof(float) * (size_t)total);
    if (!p) return -1;
    float **slots[6] = {&w->q, &w->scores, &w->part, &w->state, &w->acc, &w->row};
    for (int i = 0; i < 6; i++) *slots[i] = p, p += (sizes[i] + 15) / 16 * 16;
    return 0;
}

/* Every decode row of a step (one new token per sequence, or a sequence's row and its drafts) in one call. */
int pagedserve_decode_attention(const DecodeArgs *a, int64_t num_seqs, int64_t max_seq_len, int num_threads) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    Span *spans = reused(SPANS, sizeof(Span) * (size_t)(num_seqs > 0 ? num_seqs : 1));
    if (!spans) return -1;
    const int64_t num_spans = split_spans(a, spans, find_spans(a, num_seqs, spans), num_threads);
    /* few pairs per thread: about SPLIT_BELOW tasks per thread (the pieces of a chunk give less imbalance than
     * whole pairs, but each costs a cold start and its partials' trip to the merging core) */
    const int64_t pairs = num_spans * a->num_kv_heads;
    int64_t pieces = num_threads > 1 && pairs < SPLIT_BELOW * num_threads
                         ? (SPLIT_BELOW * num_threads + pairs - 1) / pairs : 0;
    while (pieces && pairs * pieces % num_threads) pieces++;  /* whole rounds of equal pieces */
    Plan plan;
    if (make_plan(a, spans, num_spans, pieces, &plan)) return -1;
    int64_t most_rows = 1;
    for (int64_t i = 0; i < num_spans; i++) most_rows = spans[i].m > most_rows ? spans[i].m : most_rows;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        Scratch w;
        failed = thread_scratch(a, most_rows * group, max_seq_len, &w) != 0;
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t i = 0; i < plan.num_tasks; i++)
            if (!failed) run_task(a, spans, &plan.tasks[i], &w);
    }
    return failed ? -1 : 0;
}

/* KEY_CHUNK, for the tests that put rows' lengths at and around it. */
int64_t pagedserve_decode_key_chunk(void) { return KEY_CHUNK; }
