/* The fp32-activation variant of the packed product (packed_linear.c takes it above int8_max_rows rows):
 * each run of 32 weights is dequantized in registers to fp32 (w = d u + m, the values gguf's dequantizer gives) and
 * multiplied with the fp32 activations by FMA. No activation rounding: the result is x @ W^T up to fp32 summation
 * order, where the int8 variant adds its per-32 rounding of x. 16 lanes per FMA where the compiler targets
 * AVX-512, 8 on AVX2, C loops elsewhere. */
#include "isa.h"
#include "packed_blocks.h"

#define PK_INLINE static inline __attribute__((always_inline))
#define PK_F32_TILE 8  /* activation rows per unpacked run: 16 zmm accumulators + 2 weight registers */

/* out[r] = dot(weight row w, x row r) for r < R; x rows are `in` apart. */
PK_INLINE void pk_f32_row_dot(int fmt, const uint8_t *w, int64_t nblocks, const float *x, int64_t in, int R,
                              float *out) {
    const int64_t bb = PK_BLOCK_BYTES[fmt];
#if defined(PS_AVX512)
    __m512 lo[PK_F32_TILE], hi[PK_F32_TILE];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_ps();
#elif defined(PS_AVX2)
    __m256 acc[PK_F32_TILE][4];
    for (int r = 0; r < R; r++) for (int g = 0; g < 4; g++) acc[r][g] = _mm256_setzero_ps();
#else
    float acc[PK_F32_TILE] = {0};
#endif
    int64_t col = 0;
    for (int64_t blk = 0; blk < nblocks; blk++) {
        const uint8_t *b = w + blk * bb;
        pk_scales s;
        const int runs = pk_block_scales(fmt, b, &s);
        for (int j = 0; j < runs; j++, col += 32) {
#if defined(PS_AVX512)
            __m256i u = pk_codes_avx2(fmt, b, j);
            __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u))),
                                        _mm512_set1_ps(s.d[j][0]), _mm512_set1_ps(s.m[j][0]));
            __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u, 1))),
                                        _mm512_set1_ps(s.d[j][1]), _mm512_set1_ps(s.m[j][1]));
            for (int r = 0; r < R; r++) {
                lo[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * in + col), lo[r]);
                hi[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * in + col + 16), hi[r]);
            }
#elif defined(PS_AVX2)
            uint8_t u[32];
            _mm256_storeu_si256((__m256i *)u, pk_codes_avx2(fmt, b, j));
            for (int g = 0; g < 4; g++) {
                __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 8 * g))));
                v = _mm256_fmadd_ps(v, _mm256_set1_ps(s.d[j][g >> 1]), _mm256_set1_ps(s.m[j][g >> 1]));
                for (int r = 0; r < R; r++) acc[r][g] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + r * in + col + 8 * g), acc[r][g]);
            }
#else
            uint8_t u[32];
            pk_codes_scalar(fmt, b, j, u);
            for (int r = 0; r < R; r++) {
                float sum = 0.0f;
                for (int l = 0; l < 32; l++) sum += (s.d[j][l >> 4] * (float)u[l] + s.m[j][l >> 4]) * x[r * in + col + l];
                acc[r] += sum;
            }
#endif
        }
    }
    for (int r = 0; r < R; r++) {
#if defined(PS_AVX512)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(lo[r], hi[r]));
#elif defined(PS_AVX2)
        out[r] = ps_hsum8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
#else
        out[r] = acc[r];
#endif
    }
}

#define PK_F32_TILES(F)                                                          \
    switch (R) {                                                                 \
    case 1: pk_f32_row_dot(F, w, nblocks, x, in, 1, out); return;                \
    case 2: pk_f32_row_dot(F, w, nblocks, x, in, 2, out); return;                \
    case 3: pk_f32_row_dot(F, w, nblocks, x, in, 3, out); return;                \
    case 4: pk_f32_row_dot(F, w, nblocks, x, in, 4, out); return;                \
    case 5: pk_f32_row_dot(F, w, nblocks, x, in, 5, out); return;                \
    case 6: pk_f32_row_dot(F, w, nblocks, x, in, 6, out); return;                \
    case 7: pk_f32_row_dot(F, w, nblocks, x, in, 7, out); return;                \
    default: pk_f32_row_dot(F, w, nblocks, x, in, PK_F32_TILE, out); return;     \
    }

void pk_f32_row_dot_any(int fmt, const uint8_t *w, int64_t nblocks, const float *x, int64_t in, int R, float *out) {
    switch (fmt) {
    case PK_Q4_0: PK_F32_TILES(PK_Q4_0)
    case PK_Q4_1: PK_F32_TILES(PK_Q4_1)
    case PK_Q5_0: PK_F32_TILES(PK_Q5_0)
    case PK_Q8_0: PK_F32_TILES(PK_Q8_0)
    case PK_Q4_K: PK_F32_TILES(PK_Q4_K)
    case PK_Q5_K: PK_F32_TILES(PK_Q5_K)
    default: PK_F32_TILES(PK_Q6_K)
    }
}
