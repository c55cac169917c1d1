/* The dense bf16 linear on rows interleaved in groups of DENSE_GROUP_ROWS (DenseLinear.row_group): the layout the
 * one-to-eight-row product reads fastest, made once at load by quant/dense_native.py (in place, same bytes).
 *
 * Layout: group g = rows 16g..16g+15, stored in place of those rows; inside it, for each input pair p (inputs 2p,
 * 2p+1) one 64-byte tile whose 32-bit word l holds row 16g+l's two weights (input 2p in the low half). One load
 * gives both inputs for all 16 rows; a shift (even input) and a mask (odd input) widen them to fp32 exactly.
 * AVX-512 builds take a tile in one register, AVX2 builds in two halves (the same sums per lane).
 */
#include "isa.h"
#include "dense_linear.h"
#include "native.h"

#if defined(PS_AVX512)

/* TILE_ROWS: activation rows per pass. PREFETCH_PAIRS: software prefetch distance in tiles (1 KB); with weights
 * read from L3 it gave 25-60% over none on SmolLM2's shapes, alike from 16 to 64 tiles ahead. */
enum { TILE_ROWS = 8, PREFETCH_PAIRS = 16 };

/* NG groups from `w` (each `pairs` tiles long) against R activation rows `x` (fp32, already rounded to bf16): two
 * FMA chains per (group, row), even and odd inputs, whatever R and NG, so a row's result does not depend on the
 * rows beside it (speculative decoding's exactness). */
INLINE void grouped_tile(const uint32_t *w, int64_t pairs, const float *x, int64_t in, float *y, int64_t out,
                         const int R, const int NG) {
    __m512 even[TILE_ROWS], odd[TILE_ROWS];  /* NG * R <= TILE_ROWS */
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    const int64_t stride = pairs * DENSE_GROUP_ROWS;
    for (int i = 0; i < NG * R; i++) even[i] = odd[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        for (int n = 0; n < NG; n++) {
            const uint32_t *tile = w + n * stride + p * DENSE_GROUP_ROWS;
            _mm_prefetch((const char *)(tile + PREFETCH_PAIRS * DENSE_GROUP_ROWS), _MM_HINT_T0);
            const __m512i v = _mm512_loadu_si512(tile);
            const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, high));
            for (int r = 0; r < R; r++) {
                even[n * R + r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(x[r * in + 2 * p]), even[n * R + r]);
                odd[n * R + r] = _mm512_fmadd_ps(hi, _mm512_set1_ps(x[r * in + 2 * p + 1]), odd[n * R + r]);
            }
        }
    }
    for (int n = 0; n < NG; n++)
        for (int r = 0; r < R; r++)
            _mm512_storeu_ps(y + r * out + n * DENSE_GROUP_ROWS, _mm512_add_ps(even[n * R + r], odd[n * R + r]));
}

/* Groups side by side per pass: enough independent chains to hide the FMA latency at one or two rows, few enough
 * accumulators to stay in the 32 registers at eight. */
#define GROUPS_PER_PASS(R) ((R) <= 2 ? 4 : (R) <= 4 ? 2 : 1)

#define GROUPED_CASE(R)                                                                                  \
    case R: {                                                                                            \
        enum { NG = GROUPS_PER_PASS(R) };                                                                \
        _Pragma("omp parallel for schedule(static) if (passes > 8)")                                     \
        for (int64_t c = 0; c < passes; c++) {                                                           \
            const int64_t g0 = c * NG;                                                                   \
            if (g0 + NG <= groups) {                                                                     \
                grouped_tile(w + g0 * gwords, pairs, x, in, y + g0 * DENSE_GROUP_ROWS, out, R, NG);      \
            } else { /* the last groups, one at a time: the same chains per row */                       \
                for (int64_t g = g0; g < groups; g++)                                                    \
                    grouped_tile(w + g * gwords, pairs, x, in, y + g * DENSE_GROUP_ROWS, out, R, 1);     \
            }                                                                                            \
        }                                                                                                \
        break;                                                                                           \
    }

/* One pass of R <= TILE_ROWS activation rows (rounded to bf16, as fp32) over every group. */
static void grouped_pass(const DenseLinear *s, const float *x, int R, float *y) {
    const int64_t in = s->in_features, out = s->out_features, pairs = in / 2;
    const int64_t groups = out / DENSE_GROUP_ROWS, gwords = pairs * DENSE_GROUP_ROWS;
    const int64_t passes = (groups + GROUPS_PER_PASS(R) - 1) / GROUPS_PER_PASS(R);
    const uint32_t *w = s->weight;
    switch (R) {
        GROUPED_CASE(1) GROUPED_CASE(2) GROUPED_CASE(3) GROUPED_CASE(4)
        GROUPED_CASE(5) GROUPED_CASE(6) GROUPED_CASE(7) GROUPED_CASE(8)
    }
}

#elif defined(PS_AVX2)

/* The AVX2 form: a group's 16 rows are two halves of 8 (one ymm each), R <= 4 activation rows per pass over a
 * half (8 chains + 2 weight registers of the 16). Per lane the AVX-512 form's sums in its order (even and odd
 * chains, added last), so this build's outputs equal that build's bit for bit. */
enum { TILE_ROWS = 8, HALF_ROWS = 4, PREFETCH_PAIRS = 16 };

INLINE void grouped_half(const uint32_t *w, int64_t pairs, int half, const float *x, int64_t in, float *y,
                         int64_t out, const int R) {
    __m256 even[HALF_ROWS], odd[HALF_ROWS];
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int r = 0; r < R; r++) even[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const uint32_t *tile = w + p * DENSE_GROUP_ROWS + 8 * half;
        if (half == 0) _mm_prefetch((const char *)(tile + PREFETCH_PAIRS * DENSE_GROUP_ROWS), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256((const __m256i *)tile);
        const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        for (int r = 0; r < R; r++) {
            even[r] = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(x + r * in + 2 * p), even[r]);
            odd[r] = _mm256_fmadd_ps(hi, _mm256_broadcast_ss(x + r * in + 2 * p + 1), odd[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * out + 8 * half, _mm256_add_ps(even[r], odd[r]));
}

/* One pass of R <= TILE_ROWS activation rows (rounded to bf16, as fp32) over every group. */
static void grouped_pass(const DenseLinear *s, const float *x, int R, float *y) {
    const int64_t in = s->in_features, out = s->out_features, pairs = in / 2;
    const int64_t groups = out / DENSE_GROUP_ROWS, gwords = pairs * DENSE_GROUP_ROWS;
    const uint32_t *w = s->weight;
#pragma omp parallel for schedule(static) if (groups > 8)
    for (int64_t g = 0; g < groups; g++)
        for (int half = 0; half < 2; half++)
            for (int r0 = 0; r0 < R; r0 += HALF_ROWS) {
                const float *xr = x + r0 * in;
                float *yr = y + r0 * out + g * DENSE_GROUP_ROWS;
                switch (R - r0 < HALF_ROWS ? R - r0 : HALF_ROWS) {
                    case 1: grouped_half(w + g * gwords, pairs, half, xr, in, yr, out, 1); break;
                    case 2: grouped_half(w + g * gwords, pairs, half, xr, in, yr, out, 2); break;
                    case 3: grouped_half(w + g * gwords, pairs, half, xr, in, yr, out, 3); break;
                    default: grouped_half(w + g * gwords, pairs, half, xr, in, yr, out, HALF_ROWS); break;
                }
            }
}
#endif

#if defined(PS_AVX2)
int ps_dense_grouped(const DenseLinear *s, const float *x, int64_t rows, float *y) {
    if (s->row_group != DENSE_GROUP_ROWS || s->w_dtype != DT_BF16 || s->in_features % 2 ||
        s->out_features % DENSE_GROUP_ROWS)
        return 1;
    const int64_t in = s->in_features, out = s->out_features;
    if (s->x_fp32) {  /* fp32 compute: the weights are widened exactly in registers, x read as it is */
        for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS)
            grouped_pass(s, x + r0 * in, rows - r0 < TILE_ROWS ? (int)(rows - r0) : TILE_ROWS, y + r0 * out);
        return 0;
    }
    float *xs = scratch(TILE_ROWS * in);
    if (!xs) return -2;
    for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {
        const int R = rows - r0 < TILE_ROWS ? (int)(rows - r0) : TILE_ROWS;
        const float *xr = x + r0 * in;
        int64_t i = 0;
        for (; i + 16 <= R * in; i += 16) {
            f32x16 v;
            memcpy(&v, xr + i, sizeof v);
            v = round16(v, DT_BF16);
            memcpy(xs + i, &v, sizeof v);
        }
        for (; i < R * in; i++) xs[i] = bf16_to_f32(f32_to_bf16(xr[i]));
        grouped_pass(s, xs, R, y + r0 * out);
    }
    free(xs);
    return 0;
}

#if defined(PS_AVX512)
const char *pagedserve_dense_grouped_isa(void) { return "avx512"; }
#else
const char *pagedserve_dense_grouped_isa(void) { return "avx2"; }
#endif
#else
int ps_dense_grouped(const DenseLinear *s, const float *x, int64_t rows, float *y) {
    (void)s, (void)x, (void)rows, (void)y;
    return 1;
}

const char *pagedserve_dense_grouped_isa(void) { return "portable"; }
#endif
