/* The sizes of the interleaved-rows layout of Q5_0, Q4_K, Q5_K and Q6_K (packed_grouped_wide.c describes the
 * layout) and their scale decoding, shared by its kernels: packed_grouped_wide.c (few activation rows),
 * packed_grouped_panel.c (many) and packed_grouped_bf16.c (dequantized into the dense grouped bf16 layout). */
#ifndef PAGEDSERVE_CPU_PACKED_WIDE_LAYOUT_H
#define PAGEDSERVE_CPU_PACKED_WIDE_LAYOUT_H

#include "act_q16.h"
#include "packed_blocks.h"

#define PKW_INLINE static inline __attribute__((always_inline))

/* The bytes of the 4-bit plane + high plane of one run, and of a tile's header. */
static inline int64_t pkw_high(int fmt) { return fmt == PK_Q6_K ? 128 : fmt == PK_Q4_K ? 0 : 64; }
static inline int64_t pkw_run_bytes(int fmt) { return 256 + pkw_high(fmt); }
static inline int64_t pkw_header(int fmt) { return fmt == PK_Q5_0 ? 32 : fmt == PK_Q6_K ? 288 : 256; }
static inline int64_t pkw_tile_bytes(int fmt) { return PK_GROUP_ROWS * PK_BLOCK_BYTES[fmt]; }
static inline int pkw_runs(int fmt) { return fmt == PK_Q5_0 ? 1 : 8; }

/* Any grouped format's tile: its runs of 32 inputs, and where run j's codes start (the 32-value formats' tiles are
 * one run each). Inline, not packed_grouped_wide.c's pkw_is_wide: an outside call in a row loop spilled every
 * vector register. */
static inline int pkp_wide(int fmt) { return fmt == PK_Q5_0 || fmt == PK_Q4_K || fmt == PK_Q5_K || fmt == PK_Q6_K; }
static inline int pkp_runs(int fmt) { return pkp_wide(fmt) ? pkw_runs(fmt) : 1; }
static inline int64_t pkp_run_at(int fmt, int j) {
    return pkp_wide(fmt) ? pkw_header(fmt) + j * pkw_run_bytes(fmt) : fmt == PK_Q4_1 ? 64 : 32;
}

#if defined(PQ_LANES8)
/* Run j's scales of tile rows 8s..8s+7: d[s] (Q6_K: d[2h + s] per input half h) and m[s]. */
PKW_INLINE void pkw_scales(int fmt, const uint8_t *tile, int j, __m256 *d, __m256 *m) {
    for (int s = 0; s < 2; s++) {
        const __m256 dr = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 16 * s)));
        if (fmt == PK_Q5_0) {
            d[s] = dr, m[s] = _mm256_mul_ps(dr, _mm256_set1_ps(-16.0f));
        } else if (fmt == PK_Q6_K) {
            for (int h = 0; h < 2; h++) {
                const __m128i sc = _mm_loadl_epi64((const __m128i *)(tile + 32 + 16 * (2 * j + h) + 8 * s));
                d[2 * h + s] = _mm256_mul_ps(dr, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
            }
        } else {
            const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(tile + 64 + 16 * j + 8 * s)));
            const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(tile + 192 + 16 * (j / 2) + 8 * s)));
            const __m256i sc = _mm256_and_si256(a, _mm256_set1_epi32(63));
            const __m256i mn = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(lo, 4 * (j & 1)), _mm256_set1_epi32(15)),
                                               _mm256_slli_epi32(_mm256_srli_epi32(a, 6), 4));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 32 + 16 * s)));
            d[s] = _mm256_mul_ps(dr, _mm256_cvtepi32_ps(sc));
            m[s] = _mm256_mul_ps(_mm256_xor_ps(dmin, _mm256_set1_ps(-0.0f)), _mm256_cvtepi32_ps(mn));
        }
    }
}
#elif defined(PS_AVX512_VNNI)
/* Run j's scales of the tile's 16 rows: d[0] (Q6_K: d[h] per input half h) and m[0]. */
PKW_INLINE void pkw_scales(int fmt, const uint8_t *tile, int j, __m512 *d, __m512 *m) {
    const __m512 dr = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tile));
    if (fmt == PK_Q5_0) {
        d[0] = dr, m[0] = _mm512_mul_ps(dr, _mm512_set1_ps(-16.0f));
    } else if (fmt == PK_Q6_K) {
        for (int h = 0; h < 2; h++) {
            const __m128i sc = _mm_loadu_si128((const __m128i *)(tile + 32 + 16 * (2 * j + h)));
            d[h] = _mm512_mul_ps(dr, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        }
    } else {
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tile + 64 + 16 * j)));
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tile + 192 + 16 * (j / 2))));
        const __m512i sc = _mm512_and_si512(a, _mm512_set1_epi32(63));
        const __m512i mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(lo, 4 * (j & 1)), _mm512_set1_epi32(15)),
                                           _mm512_slli_epi32(_mm512_srli_epi32(a, 6), 4));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 32)));
        d[0] = _mm512_mul_ps(dr, _mm512_cvtepi32_ps(sc));
        m[0] = _mm512_mul_ps(_mm512_xor_ps(dmin, _mm512_set1_ps(-0.0f)), _mm512_cvtepi32_ps(mn));
    }
}
#endif

#endif
