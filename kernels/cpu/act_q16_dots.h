/* The integer tile products of the interleaved-row kernels (packed_grouped.c: GGUF Q4_0/Q4_1/Q8_0; group_grouped.c:
 * GPTQ/AWQ 4/8-bit; the panel and wide kernels) over act_q16.h's int16 activations: per 16-row tile, the 16 rows'
 * exact int32 dots with each activation row's 32 codes, 16 lanes on AVX512-VNNI (vpdpwssd) and two 8-lane halves on
 * the rest (PQ_LANES8: vpdpwssd with AVX-VNNI, vpmaddwd + vpaddd otherwise), then one block's float epilogue.
 * act_q16.h states the rounding, the exactness of the sums and the 4-bit order these read the codes in. */
#ifndef PAGEDSERVE_CPU_ACT_Q16_DOTS_H
#define PAGEDSERVE_CPU_ACT_Q16_DOTS_H

#include "act_q16.h"

#if defined(PS_AVX512_VNNI)

/* Integer chains per activation row: two while few rows leave the dot latency exposed, one from 5 rows on, where
 * the rows hide it and a second set of accumulators would spill (8 rows x 2 + 8 totals + codes > 32 registers).
 * Any split of exact int32 sums gives the same total, so a row's result does not depend on R. */
#define PQ_CHAINS(R) ((R) <= 4 ? 2 : 1)

/* v shifted right by s bits (left when s < 0) in each 32-bit lane; s a constant after unrolling (the 4-bit
 * tiles' code extraction in every 16-lane kernel). */
PQ_INLINE __m512i pq_shift32(__m512i v, int s) {
    return s > 0 ? _mm512_srli_epi32(v, s) : s < 0 ? _mm512_slli_epi32(v, -s) : v;
}

/* tot + (d da) dot + m sx: one block's 16 rows for one activation row, scaled back from its integer dot (the same
 * instructions for every row, whatever R). with_offset 0: signed codes, no offset term (Q8_0). */
PQ_INLINE __m512 pq_block_total(__m512 tot, __m512i dot, __m512 d, __m512 m, float da, float sx, int with_offset) {
    tot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(da)), tot);
    return with_offset ? _mm512_fmadd_ps(m, _mm512_set1_ps(sx), tot) : tot;
}

/* acc[r] = the 16 rows' integer dots of a 4-bit tile's codes with activation row r's 32 codes (q + r * qstride,
 * 4-bit order); acc[R + r] is scratch. */
PQ_INLINE void pq_dots4(const uint8_t *codes, const int16_t *q, int64_t qstride, int R, __m512i *acc) {
    const __m512i low4 = _mm512_set1_epi32(0x000F000F);
    for (int r = 0; r < PQ_CHAINS(R) * R; r++) acc[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i word = _mm512_loadu_si512(codes + 64 * c);
        for (int p = 0; p < 4; p++) {
            const __m512i u = _mm512_and_si512(p ? _mm512_srli_epi32(word, 4 * p) : word, low4);
            for (int r = 0; r < R; r++) {
                const int a = (PQ_CHAINS(R) == 2 && (p & 1)) * R + r;
                const __m512i pair = _mm512_set1_epi32(pq_pair(q + r * qstride + 8 * c + 2 * p));
                acc[a] = _mm512_dpwssd_epi32(acc[a], u, pair);
            }
        }
    }
    for (int r = 0; PQ_CHAINS(R) == 2 && r < R; r++) acc[r] = _mm512_add_epi32(acc[r], acc[R + r]);
}

/* byte j of the gathered chunk: row j / 2 % 16's code of input 2 (j / 32) + j % 2 = byte 16 (that input) + row */
static const uint8_t PQ_PAIR_GATHER[64] = {
    0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26, 11, 27, 12, 28, 13, 29,
    14, 30, 15, 31, 32, 48, 33, 49, 34, 50, 35, 51, 36, 52, 37, 53, 38, 54, 39, 55, 40, 56, 41, 57, 42, 58, 43, 59,
    44, 60, 45, 61, 46, 62, 47, 63};

/* The same for an 8-bit tile (32 inputs x 16 bytes, byte r of input k's 16 = row r's code), natural order;
 * is_signed: the codes are int8 (Q8_0), else uint8. */
PQ_INLINE void pq_dots8(const uint8_t *codes, int is_signed, const int16_t *q, int64_t qstride, int R, __m512i *acc) {
    const __m512i gather = _mm512_loadu_si512(PQ_PAIR_GATHER);
    const int hi_at = PQ_CHAINS(R) == 2 ? R : 0;
    for (int r = 0; r < PQ_CHAINS(R) * R; r++) acc[r] = _mm512_setzero_si512();
    for (int c = 0; c < 8; c++) {
        const __m512i pairs = _mm512_permutexvar_epi8(gather, _mm512_loadu_si512(codes + 64 * c));
        const __m256i lo8 = _mm512_castsi512_si256(pairs), hi8 = _mm512_extracti64x4_epi64(pairs, 1);
        const __m512i lo = is_signed ? _mm512_cvtepi8_epi16(lo8) : _mm512_cvtepu8_epi16(lo8);  /* inputs 4c, 4c+1 */
        const __m512i hi = is_signed ? _mm512_cvtepi8_epi16(hi8) : _mm512_cvtepu8_epi16(hi8);  /* 4c+2, 4c+3 */
        for (int r = 0; r < R; r++) {
            const int16_t *qa = q + r * qstride + 4 * c;
            acc[r] = _mm512_dpwssd_epi32(acc[r], lo, _mm512_set1_epi32(pq_pair(qa)));
            acc[hi_at + r] = _mm512_dpwssd_epi32(acc[hi_at + r], hi, _mm512_set1_epi32(pq_pair(qa + 2)));
        }
    }
    for (int r = 0; PQ_CHAINS(R) == 2 && r < R; r++) acc[r] = _mm512_add_epi32(acc[r], acc[R + r]);
}
#elif defined(PQ_LANES8)
/* A tile's 16 rows in two 8-lane halves: acc[2r] rows 0-7 and acc[2r + 1] rows 8-15 of activation row r. Two
 * chains per half while few rows leave vpdpwssd's latency exposed (AVX-VNNI), one from 3 rows on (16 registers). */
#define PQ_CHAINS(R) ((R) <= 2 ? 2 : 1)

/* v shifted right by s bits (left when s < 0) in each 32-bit lane; s a constant after unrolling (the 4-bit
 * tiles' code extraction in every 8-lane kernel). */
PQ_INLINE __m256i pq_shift32(__m256i v, int s) {
    return s > 0 ? _mm256_srli_epi32(v, s) : s < 0 ? _mm256_slli_epi32(v, -s) : v;
}

/* acc + the pairwise int16 products of u and pair, summed per int32 lane (isa.h's ps_dpwssd8). */
PQ_INLINE __m256i pq_dpwssd(__m256i acc, __m256i u, __m256i pair) { return ps_dpwssd8(acc, u, pair); }

/* pq_block_total of one half: the same instructions per lane as the 16-lane form, so the same result. */
PQ_INLINE __m256 pq_block_total8(__m256 tot, __m256i dot, __m256 d, __m256 m, float da, float sx, int with_offset) {
    tot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(da)), tot);
    return with_offset ? _mm256_fmadd_ps(m, _mm256_set1_ps(sx), tot) : tot;
}

PQ_INLINE void pq_chains_merge(int R, __m256i *acc) {
    for (int i = 0; PQ_CHAINS(R) == 2 && i < 2 * R; i++) acc[i] = _mm256_add_epi32(acc[i], acc[2 * R + i]);
}

/* acc[2r], acc[2r + 1] = the 16 rows' integer dots of a 4-bit tile's codes with activation row r's 32 codes
 * (q + r * qstride, 4-bit order); acc[2R...] is scratch. (word >> 4p) & 0x000F000F holds a row's inputs 8c + p and
 * 8c + p + 4 as two int16, the order pq_quantize stored the activations in. */
PQ_INLINE void pq_dots4(const uint8_t *codes, const int16_t *q, int64_t qstride, int R, __m256i *acc) {
    const __m256i low4 = _mm256_set1_epi32(0x000F000F);
    for (int i = 0; i < 2 * PQ_CHAINS(R) * R; i++) acc[i] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(codes + 64 * c));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(codes + 64 * c + 32));
        for (int p = 0; p < 4; p++) {
            const __m256i u0 = _mm256_and_si256(p ? _mm256_srli_epi32(w0, 4 * p) : w0, low4);
            const __m256i u1 = _mm256_and_si256(p ? _mm256_srli_epi32(w1, 4 * p) : w1, low4);
            const int at = (PQ_CHAINS(R) == 2 && (p & 1)) * 2 * R;
            for (int r = 0; r < R; r++) {
                const __m256i pair = _mm256_set1_epi32(pq_pair(q + r * qstride + 8 * c + 2 * p));
                acc[at + 2 * r] = pq_dpwssd(acc[at + 2 * r], u0, pair);
                acc[at + 2 * r + 1] = pq_dpwssd(acc[at + 2 * r + 1], u1, pair);
            }
        }
    }
    pq_chains_merge(R, acc);
}

/* The same for an 8-bit tile (32 inputs x 16 bytes, byte r of input k's 16 = row r's code), natural order:
 * inputs k and k + 1 interleaved byte by byte give each row's pair; is_signed: int8 codes (Q8_0), else uint8. */
PQ_INLINE void pq_dots8(const uint8_t *codes, int is_signed, const int16_t *q, int64_t qstride, int R, __m256i *acc) {
    for (int i = 0; i < 2 * PQ_CHAINS(R) * R; i++) acc[i] = _mm256_setzero_si256();
    for (int k = 0; k < 32; k += 2) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(codes + 16 * k));
        const __m128i b = _mm_loadu_si128((const __m128i *)(codes + 16 * k + 16));
        const __m128i lo8 = _mm_unpacklo_epi8(a, b), hi8 = _mm_unpackhi_epi8(a, b);  /* rows 0-7, rows 8-15 */
        const __m256i u0 = is_signed ? _mm256_cvtepi8_epi16(lo8) : _mm256_cvtepu8_epi16(lo8);
        const __m256i u1 = is_signed ? _mm256_cvtepi8_epi16(hi8) : _mm256_cvtepu8_epi16(hi8);
        const int at = (PQ_CHAINS(R) == 2 && (k & 2)) * 2 * R;
        for (int r = 0; r < R; r++) {
            const __m256i pair = _mm256_set1_epi32(pq_pair(q + r * qstride + k));
            acc[at + 2 * r] = pq_dpwssd(acc[at + 2 * r], u0, pair);
            acc[at + 2 * r + 1] = pq_dpwssd(acc[at + 2 * r + 1], u1, pair);
        }
    }
    pq_chains_merge(R, acc);
}
#endif

#endif
