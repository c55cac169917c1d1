/* What the decode attention's per-chunk math (decode_attention.c) and its scheduler (decode_tasks.c) share.
 *
 * A row's keys are cut at fixed absolute positions into chunks [c * KEY_CHUNK, (c + 1) * KEY_CHUNK). Each chunk
 * gives every query of a span a partial: its own max score, the sum of its softmax numerators, and the numerators
 * times V; the partials are then merged per query in chunk order. The cuts depend on nothing but the key position,
 * so a row's result is the same bits whether its chunks run on one thread or several, alone or in a span. */
#ifndef PAGEDSERVE_CPU_DECODE_CHUNKS_H
#define PAGEDSERVE_CPU_DECODE_CHUNKS_H

#include "decode_attention.h"

#ifndef KEY_CHUNK
#define KEY_CHUNK 512  /* a multiple of every block size (8-128); 128 and 256 cost 16-row batches 1-7% */
#endif
#define SPAN_QUERIES 32  /* query vectors (rows x query heads per KV head) in one task: bounds the score buffer */

/* A run of consecutive decode rows that read the same cached keys: one sequence's row and its speculative draft
 * rows (each a row of its own, its context ending at its own position). */
typedef struct { int64_t s, m; } Span;

/* The keys [k0, k1) of one chunk of a task (k0 and k1 within the span's [lo, hi)). */
typedef struct { int64_t k0, k1, hi; const int32_t *table; } Keys;

/* One thread's buffers, reused across calls (decode_tasks.c): queries, scores of one chunk (of all keys for
 * the scalar code), one chunk's partials, the merged state, and the scalar code's rows. */
typedef struct { float *q, *scores, *part, *state, *acc, *row; } Scratch;

/* Floats per query in a partial: the numerators times V [head_dim], then the max score and the numerators' sum;
 * rounded up to whole 64-byte lines. */
static inline int64_t partial_stride(int64_t head_dim) { return (head_dim + 2 + 15) / 16 * 16; }

/* The keys a span sees: [lo, hi). */
void span_keys(const DecodeArgs *a, const Span *sp, int64_t *lo, int64_t *hi);

/* Partials of the span's queries that share KV head h over chunk c of its keys (head_dim a multiple of 16). */
void decode_chunk(const DecodeArgs *a, const Span *sp, int64_t h, int64_t c, Scratch *w, float *part);

/* head_dim not a multiple of 16: the span's rows one by one over all their keys, straight to the output. */
void decode_rows_scalar(const DecodeArgs *a, const Span *sp, int64_t h, Scratch *w);

#endif
