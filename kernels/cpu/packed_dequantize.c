/* Rows of a packed matrix as fp32 or bf16 values: the embedding lookup and the prefill path's dequantized tile.
 * Values equal gguf's dequantizers' (w = d u + m in one rounding). */
#include "isa.h"
#include <math.h>
#include <omp.h>

#include "packed_blocks.h"

#define PK_EXPORT __attribute__((visibility("default")))

static inline uint16_t pk_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* quiet NaN */
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);  /* round to nearest even */
}

void pk_grouped_row_run(const ps_packed_state *st, int64_t row, int64_t b, uint8_t *u, float *d, float *m);

/* 32 values w = d u + m (d, m per 16-value half) into dst (fp32 or bf16) from element `at` on. */
static inline void pk_store_run(const uint8_t *u, const float *d, const float *m, void *dst, int64_t at, int to_bf16) {
#if defined(PS_AVX2)
    for (int g = 0; g < 4; g++) {
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 8 * g))));
        v = _mm256_fmadd_ps(v, _mm256_set1_ps(d[g >> 1]), _mm256_set1_ps(m[g >> 1]));
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
    for (int l = 0; l < 32; l++) {
        float v = fmaf(d[l >> 4], (float)u[l], m[l >> 4]);
        if (to_bf16) ((uint16_t *)dst)[at + l] = pk_bf16(v);
        else ((float *)dst)[at + l] = v;
    }
#endif
}

/* Row `row` of W into dst from element `at` on. */
static void pk_dequantize_row(const ps_packed_state *st, int64_t row, void *dst, int64_t at, int to_bf16) {
    const int fmt = st->format;
    const int64_t nblocks = st->in_features / PK_BLOCK_VALUES[fmt];
    uint8_t u[32];
    if (st->row_group) {
        for (int64_t run = 0; run < st->in_features / 32; run++, at += 32) {
            float d[2], m[2];
            pk_grouped_row_run(st, row, run, u, d, m);
            pk_store_run(u, d, m, dst, at, to_bf16);
        }
        return;
    }
    const uint8_t *w = st->data + row * st->row_bytes;
    for (int64_t blk = 0; blk < nblocks; blk++) {
        pk_scales s;
        const uint8_t *b = w + blk * PK_BLOCK_BYTES[fmt];
        const int runs = pk_block_scales(fmt, b, &s);
        for (int j = 0; j < runs; j++, at += 32) {
#if defined(PS_AVX2)
            _mm256_storeu_si256((__m256i *)u, pk_codes_avx2(fmt, b, j));
#else
            pk_codes_scalar(fmt, b, j, u);
#endif
            pk_store_run(u, s.d[j], s.m[j], dst, at, to_bf16);
        }
    }
}

/* Rows `ids` (NULL: 0..n-1) of W as fp32 or bf16 values [n, in]: the embedding lookup and the prefill tile. */
PK_EXPORT int pagedserve_packed_dequantize(const ps_packed_state *st, const int64_t *ids, int64_t n, void *dst,
                                           int to_bf16, int threads) {
    if (pk_check(st) || n < 0) return 1;
    for (int64_t i = 0; ids != NULL && i < n; i++)
        if (ids[i] < 0 || ids[i] >= st->out_features) return 3;
    const int64_t in = st->in_features;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t i = 0; i < n; i++) pk_dequantize_row(st, ids ? ids[i] : i, dst, i * in, to_bf16);
    return 0;
}

