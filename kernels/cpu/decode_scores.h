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

/* Scores of 16 keys (m of them real, from key row i0 of `tile`) for all the span's queries: the keys widened to
 * fp32 once for all queries; each query's 16 dot vectors then stay in registers up to their lane sums (a
 * [query][key] buffer of them cost a store and a load each). The prefetches run ahead to `next_k` and this tile's V,
 * V only into L2 (locality 2: prefetcht1): the values pass reads it a chunk later (KEY_CHUNK keys, 32-64 KiB of V at
 * head dim 64), and pulled into L1 it evicted the K rows prefetched for the next tiles before their turn (a Zen 4's
 * 32 KiB L1: int8 decode attention 1.02-1.17x faster, bf16 1.03-1.11x, FP8 1.05-1.08x; the AVX2 build's int8
 * 1.11-1.20x, FP8 even; benchmarks/decode_attention_ab.py). */
INLINE void score16(const char *tile, const char *next_k, const char *v_tile, int64_t i0, int64_t m, const f32x16 *q,
                    int64_t nq, float *dst, const int64_t chunks, const int kv_dt) {
    const size_t kv_row = (size_t)16 * chunks * elem_size(kv_dt);
    f32x16 kf[16][chunks];
    for (int64_t i = 0; i < 16; i++) {
        if (i >= m) {
            for (int64_t c = 0; c < chunks; c++) kf[i][c] = (f32x16){0};
            continue;
        }
        /* Spread over the key loop: a burst of 2 * tile_bytes / 64 prefetches would fill the miss buffers and
         * stall on them. */
        for (size_t line = 0; line < kv_row; line += 64) {
            __builtin_prefetch(next_k + (i0 + i) * kv_row + line);
            __builtin_prefetch(v_tile + (i0 + i) * kv_row + line, 0, 2);
        }
        kv_widen_row(tile + (i0 + i) * kv_row, chunks, kv_dt, kf[i]);
    }
    for (int64_t qq = 0; qq < nq; qq++) {
        f32x16 dots[16];
        for (int64_t i = 0; i < 16; i++) {
            f32x16 dot = q[qq * chunks] * kf[i][0];
            for (int64_t c = 1; c < chunks; c++) dot += q[qq * chunks + c] * kf[i][c];
            dots[i] = dot;
        }
        const f32x16 sums = hsum16x16(dots);
        /* a constant size is one store; a variable one became `rep movsq` (~10% of the kernel) */
        if (m == 16) memcpy(dst + qq * KEY_CHUNK, &sums, sizeof sums);
        else memcpy(dst + qq * KEY_CHUNK, &sums, sizeof(float) * (size_t)m);
    }
}

/* score16 for int8 K (kv_dot.h): each key's int32 dot with the int16 queries q16 ([nq][chunks], each chunk twice),
 * times the query's scale qs[qq] and the key row's scale. Keys go in pairs, one pair per vector (kv_dot_widen_pair):
 * the lane sums then take 14 shuffles per query and 16 keys instead of 30. */
INLINE void score16_i8(const char *tile, const char *next_k, const char *v_tile, int64_t i0, int64_t m,
                       const i16x32 *q16, const float *qs, int64_t nq, float *dst, const _Float16 *rs,
                       const int64_t chunks) {
    const size_t kv_row = (size_t)16 * chunks;
    for (int64_t i = 0; i < m; i++)
        for (size_t line = 0; line < kv_row; line += 64) {
            __builtin_prefetch(next_k + (i0 + i) * kv_row + line);
            __builtin_prefetch(v_tile + (i0 + i) * kv_row + line, 0, 2);  /* into L2, as score16's */
        }
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
        if (m == 16) memcpy(dst + qq * KEY_CHUNK, &sums, sizeof sums);
        else memcpy(dst + qq * KEY_CHUNK, &sums, sizeof(float) * (size_t)m);
    }
}

/* Scores of all the span's queries over the chunk's keys: scores[qq * KEY_CHUNK + t - k0]. int8 K: q16 and qs are
 * the queries rounded to int16 and their scales (kv_dot_quantize), q is not read. */
INLINE void chunk_scores(const DecodeArgs *a, const Keys *k, int64_t h, const f32x16 *q, const i16x32 *q16,
                         const float *qs, int64_t nq, float *scores, const int64_t chunks, const int kv_dt) {
    const int64_t bs = a->block_size;
    const size_t tile_bytes = (size_t)bs * 16 * chunks * elem_size(kv_dt);
    /* The K tile prefetched is about 2 KiB of keys ahead: an 8-bit tile is scored in half a 16-bit one's time, so one
     * tile ahead left its loads waiting on memory (the top stall of int8 decode at 4k keys). */
    const int64_t ahead = tile_bytes >= 2048 ? 1 : tile_bytes >= 512 ? (int64_t)(2048 / tile_bytes) : 4;
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
            if (kv_dt == DT_I8)
                score16_i8(tile, next_k, (const char *)a->v_cache + offset, i0, m, q16, qs, nq,
                           scores + t0 + i0 - k->k0, rs, chunks);
            else
                score16(tile, next_k, (const char *)a->v_cache + offset, i0, m, q, nq, scores + t0 + i0 - k->k0,
                        chunks, kv_dt);
        }
    }
}

#endif
