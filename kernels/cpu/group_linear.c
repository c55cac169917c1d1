/* y[rows, out] = x[rows, in] @ W^T (+ bias) with W in GPTQ/AWQ groups, read in place: the ps_linear_fn of
 * kernels/cpu/linear.h for group-quantized weights (state built by quant/cpu_group_kernel.py).
 *
 * Layout (made once at load from the canonical GroupQuantWeight): input channels in group order (act-order's
 * permutation `perm` is applied to x per call instead), so every run of 32 inputs lies in one group `run_group[j]`.
 * codes [out, in * bits / 8]: per output row, per run of 32, 16 bytes whose low nibbles are values 0-15 and high
 * nibbles values 16-31 (4-bit), or 32 bytes (8-bit); scales [out, groups] fp16 or fp32, zeros uint8 [out, groups].
 * Where the build has AVX2 or AVX-512 and out % 16 == 0 the loader interleaves rows in groups of 16 instead (row_group,
 * group_grouped.c, faster for 1-8 rows); the product and the expansion below hand such matrices over to it.
 *
 * Each run is dequantized in registers to fp32 as w = u * s + (-z * s) by one FMA; -z * s is exact in fp32 for
 * fp16 scales, so w is the reference's (q - z) * s bit for bit, and y is x @ W^T up to fp32 summation order.
 * 16 lanes per FMA where the build has AVX-512, 8 where it has AVX2 (+FMA), portable C elsewhere (the tests build
 * every tier the host runs).
 * Work splits over output rows (OpenMP on torch's pool); a weight run is dequantized once for up to 8 x rows. */
#include "isa.h"
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "group_state.h"
#include "linear.h"

#define GQ_EXPORT __attribute__((visibility("default")))
#define GQ_INLINE static inline __attribute__((always_inline))
/* x rows per dequantized run: AVX-512, 16 zmm accumulators + 2 weight registers; AVX2 (16 ymm registers), 8
 * accumulators + 4 weight registers. A row's sums never depend on the tile, so any value keeps rows independent. */
#if defined(PS_AVX512)
#define GQ_TILE 8
#elif defined(PS_AVX2)
#define GQ_TILE 4
#else
#define GQ_TILE 8
#endif
#define GQ_CHUNK 16  /* output rows per unit of parallel work */

/* The 32 codes of run j of one output row, widened to fp32 weights (portable). */
GQ_INLINE void gq_run_scalar(const uint8_t *c, int bits, int64_t j, float d, float m, float *w) {
    if (bits == 4) {
        const uint8_t *b = c + 16 * j;
        for (int l = 0; l < 16; l++) {
            w[l] = (float)(b[l] & 0xF) * d + m;
            w[l + 16] = (float)(b[l] >> 4) * d + m;
        }
    } else {
        const uint8_t *b = c + 32 * j;
        for (int l = 0; l < 32; l++) w[l] = (float)b[l] * d + m;
    }
}

/* out[r] = dot(weight row o, x row r) for r < R; bits and R are constants after inlining. */
GQ_INLINE void gq_row_dot(const ps_group_state *st, int64_t o, const float *x, int bits, int R, float *out) {
    const int64_t in = st->in_features, runs = in / 32, row_bytes = in * bits / 8;
    const uint8_t *c = st->codes + o * row_bytes, *z = st->zeros + o * st->groups;
    int32_t cur = -1;
    float d = 0.0f, m = 0.0f;
#if defined(PS_AVX512)
    __m512 lo[GQ_TILE], hi[GQ_TILE], vd = _mm512_setzero_ps(), vm = vd;
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_ps();
#elif defined(PS_AVX2)
    /* two chains per row (runs' quarters 0, 2 and 1, 3): the 4-cycle FMA latency half hidden at one row */
    __m256 lo[GQ_TILE], hi[GQ_TILE], vd = _mm256_setzero_ps(), vm = vd;
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
#else
    float acc[GQ_TILE] = {0};
#endif
    for (int64_t j = 0; j < runs; j++) {
        const int32_t g = st->run_group[j];
        if (g != cur) {
            cur = g;
            d = gq_scale(st, o * st->groups + g);
            m = -(float)z[g] * d;
#if defined(PS_AVX512)
            vd = _mm512_set1_ps(d);
            vm = _mm512_set1_ps(m);
#elif defined(PS_AVX2)
            vd = _mm256_set1_ps(d);
            vm = _mm256_set1_ps(m);
#endif
        }
#if defined(PS_AVX512)
        __m512i u0, u1;
        if (bits == 4) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16 * j)));
            u0 = _mm512_and_si512(b, _mm512_set1_epi32(0xF));
            u1 = _mm512_srli_epi32(b, 4);  /* one widening shuffle per run, not two: measured 6-20% faster */
        } else {
            u0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 32 * j)));
            u1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 32 * j + 16)));
        }
        const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u0), vd, vm);
        const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u1), vd, vm);
        for (int r = 0; r < R; r++) {
            lo[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * in + 32 * j), lo[r]);
            hi[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * in + 32 * j + 16), hi[r]);
        }
#elif defined(PS_AVX2)
        __m256i u[4];  /* inputs 8q..8q+7 of the run */
        if (bits == 4) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(c + 16 * j));
            const __m256i b0 = _mm256_cvtepu8_epi32(b), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
            const __m256i low = _mm256_set1_epi32(0xF);
            u[0] = _mm256_and_si256(b0, low);
            u[1] = _mm256_and_si256(b1, low);
            u[2] = _mm256_srli_epi32(b0, 4);
            u[3] = _mm256_srli_epi32(b1, 4);
        } else {
            for (int q = 0; q < 4; q++) u[q] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 32 * j + 8 * q)));
        }
        /* the same exact weights as the AVX-512 and portable forms: u d + m by one FMA */
        for (int q = 0; q < 4; q++) {
            const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(u[q]), vd, vm);
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_loadu_ps(x + r * in + 32 * j + 8 * q);
                if (q & 1) hi[r] = _mm256_fmadd_ps(w, xv, hi[r]);
                else lo[r] = _mm256_fmadd_ps(w, xv, lo[r]);
            }
        }
#else
        float w[32];
        gq_run_scalar(c, bits, j, d, m, w);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * in + 32 * j;
            float sum = 0.0f;
            for (int l = 0; l < 32; l++) sum += w[l] * xr[l];
            acc[r] += sum;
        }
#endif
    }
    for (int r = 0; r < R; r++) {
#if defined(PS_AVX512)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(lo[r], hi[r]));
#elif defined(PS_AVX2)
        out[r] = ps_hsum8(_mm256_add_ps(lo[r], hi[r]));
#else
        out[r] = acc[r];
#endif
    }
}

/* R < GQ_TILE as a constant (the larger cases only where the tile holds them), else a full tile. */
#if GQ_TILE > 4
#define GQ_TILES_WIDE(B)                                         \
    case 5: gq_row_dot(st, o, x, B, 5, out); return;             \
    case 6: gq_row_dot(st, o, x, B, 6, out); return;             \
    case 7: gq_row_dot(st, o, x, B, 7, out); return;
#else
#define GQ_TILES_WIDE(B)
#endif
#define GQ_TILES(B)                                              \
    switch (R) {                                                 \
    case 1: gq_row_dot(st, o, x, B, 1, out); return;             \
    case 2: gq_row_dot(st, o, x, B, 2, out); return;             \
    case 3: gq_row_dot(st, o, x, B, 3, out); return;             \
    GQ_TILES_WIDE(B)                                             \
    default: gq_row_dot(st, o, x, B, GQ_TILE, out); return;      \
    }

static void gq_row_dot_any(const ps_group_state *st, int64_t o, const float *x, int R, float *out) {
    if (st->bits == 4) { GQ_TILES(4) }
    GQ_TILES(8)
}

GQ_EXPORT int pagedserve_group_linear_threads(const ps_group_state *st, const float *x, int64_t rows, float *y,
                                              int threads) {
    if (gq_check(st) || rows < 0 || x == NULL || y == NULL) return 1;
    const int64_t in = st->in_features, out = st->out_features, chunks = (out + GQ_CHUNK - 1) / GQ_CHUNK;
    float *xs = NULL;
    if (st->perm != NULL) {  /* act-order: x's columns in the weights' group order, once per call */
        xs = malloc(sizeof(float) * (size_t)(rows * in) + 1);
        if (xs == NULL) return 2;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t k = 0; k < in; k++) xs[r * in + k] = x[r * in + st->perm[k]];
        x = xs;
    }
    if (st->row_group) {
        const int status = gq_grouped_product(st, x, rows, y, threads);
        free(xs);
        return status;
    }
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t ch = 0; ch < chunks; ch++) {
        const int64_t o_end = (ch + 1) * GQ_CHUNK < out ? (ch + 1) * GQ_CHUNK : out;
        for (int64_t r0 = 0; r0 < rows; r0 += GQ_TILE) {
            const int R = rows - r0 < GQ_TILE ? (int)(rows - r0) : GQ_TILE;
            for (int64_t o = ch * GQ_CHUNK; o < o_end; o++) {
                float dots[GQ_TILE];
                gq_row_dot_any(st, o, x + r0 * in, R, dots);
                const float bias = st->bias ? st->bias[o] : 0.0f;
                for (int r = 0; r < R; r++) y[(r0 + r) * out + o] = dots[r] + bias;
            }
        }
    }
    free(xs);
    return 0;
}

/* The ps_linear_fn of kernels/cpu/linear.h. */
GQ_EXPORT int pagedserve_group_linear(const void *state, const float *x, int64_t rows, float *y) {
    const ps_group_state *st = state;
    if (st == NULL) return 1;
    return pagedserve_group_linear_threads(st, x, rows, y, st->num_threads > 0 ? st->num_threads : omp_get_max_threads());
}

/* W [out, in] in the sorted input order, as fp32 (bf16 != 0: bf16, rounded to nearest even): for many-row calls,
 * which multiply the expanded matrix with a dense GEMM. */
GQ_EXPORT int pagedserve_group_dequantize(const ps_group_state *st, void *w_out, int bf16, int threads) {
    if (gq_check(st) || w_out == NULL) return 1;
    const int64_t in = st->in_features, runs = in / 32, row_bytes = in * st->bits / 8;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t o = 0; o < st->out_features; o++) {
        float w[32];
        for (int64_t j = 0; j < runs; j++) {
            const int64_t at = gq_sz_index(st, o, st->run_group[j]);
            const float d = gq_scale(st, at), m = -(float)st->zeros[at] * d;
            if (st->row_group) {  /* the grouped layout: this row's codes gathered, then the same expansion */
                uint8_t u[32];
                gq_grouped_codes(st, o, j, u);
                for (int l = 0; l < 32; l++) w[l] = (float)u[l] * d + m;
            } else {
                gq_run_scalar(st->codes + o * row_bytes, st->bits, j, d, m, w);
            }
            if (!bf16) {
                memcpy((float *)w_out + o * in + 32 * j, w, sizeof w);
                continue;
            }
            uint16_t *dst = (uint16_t *)w_out + o * in + 32 * j;
            for (int l = 0; l < 32; l++) {
                uint32_t bits;
                memcpy(&bits, &w[l], 4);
                dst[l] = (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
            }
        }
    }
    return 0;
}

#if defined(PS_AVX512)
GQ_EXPORT const char *pagedserve_group_isa(void) { return "avx512"; }
#elif defined(PS_AVX2)
GQ_EXPORT const char *pagedserve_group_isa(void) { return "avx2"; }
#else
GQ_EXPORT const char *pagedserve_group_isa(void) { return "portable"; }
#endif

PS_SIZEOF(group_state, ps_group_state)
