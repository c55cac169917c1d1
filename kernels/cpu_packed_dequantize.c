/* Rows of a packed matrix as fp32 or bf16 values: the embedding lookup and the prefill path's dequantized tile.
 * Values equal gguf's dequantizers' (w = d u + m in one rounding). */
#include <math.h>
#include <omp.h>

#include "cpu_packed_blocks.h"

#define PK_EXPORT __attribute__((visibility("default")))

static inline uint16_t pk_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* quiet NaN */
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);  /* round to nearest even */
}

/* The 32 values of run j of block b into dst (fp32 or bf16) from element `at` on. */
static inline void pk_dequantize_run(int fmt, const uint8_t *b, int j, const pk_scales *s, void *dst, int64_t at,
                                     int to_bf16) {
#if defined(__AVX2__)
    uint8_t u[32];
    _mm256_storeu_si256((__m256i *)u, pk_codes_avx2(fmt, b, j));
    for (int g = 0; g < 4; g++) {
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 8 * g))));
        v = _mm256_fmadd_ps(v, _mm256_set1_ps(s->d[j][g >> 1]), _mm256_set1_ps(s->m[j][g >> 1]));
        if (!to_bf16) {
            _mm256_storeu_ps((float *)dst + at + 8 * g, v);
            continue;
        }
        __m256i bits = _mm256_castps_si256(v);  /* round to nearest even; weights are finite */
        bits = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                       _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1))));
        bits = _mm256_srli_epi32(bits, 16);
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
        _mm_storeu_si128((__m128i *)((uint16_t *)dst + at + 8 * g), packed);
    }
#else
    uint8_t u[32];
    pk_codes_scalar(fmt, b, j, u);
    for (int l = 0; l < 32; l++) {
        float v = fmaf(s->d[j][l >> 4], (float)u[l], s->m[j][l >> 4]);
        if (to_bf16) ((uint16_t *)dst)[at + l] = pk_bf16(v);
        else ((float *)dst)[at + l] = v;
    }
#endif
}

/* Rows `ids` (NULL: 0..n-1) of W as fp32 or bf16 values [n, in]: the embedding lookup and the prefill tile. */
PK_EXPORT int pagedserve_packed_dequantize(const ps_packed_state *st, const int64_t *ids, int64_t n, void *dst,
                                           int to_bf16, int threads) {
    if (pk_check(st) || n < 0) return 1;
    for (int64_t i = 0; ids != NULL && i < n; i++)
        if (ids[i] < 0 || ids[i] >= st->out_features) return 3;
    const int fmt = st->format;
    const int64_t in = st->in_features, nblocks = in / PK_BLOCK_VALUES[fmt];
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *w = st->data + (ids ? ids[i] : i) * st->row_bytes;
        int64_t col = 0;
        for (int64_t blk = 0; blk < nblocks; blk++) {
            pk_scales s;
            const uint8_t *b = w + blk * PK_BLOCK_BYTES[fmt];
            int runs = pk_block_scales(fmt, b, &s);
            for (int j = 0; j < runs; j++, col += 32) pk_dequantize_run(fmt, b, j, &s, dst, i * in + col, to_bf16);
        }
    }
    return 0;
}

