/* GPTQ/AWQ matrices with their output rows interleaved in groups of GQ_ROWS (ps_group_state.row_group): the layout
 * the one-to-eight-row product reads fastest, made once at load (kernels/cpu/group_packed.py, `grouped()`) where
 * the build has AVX2 or AVX-512 and out_features % GQ_ROWS == 0. Same idea as packed_grouped.c's Q4_0/Q4_1 layout.
 *
 * Why: one output row after another (group_linear.c), every run of 32 codes is widened lane by lane, turned
 * into weights, multiplied with 32 activations and finally reduced across the register per row. With 16 rows side
 * by side one register holds one input's code for all 16 rows, an FMA with the broadcast activation accumulates
 * it, no horizontal sums, and a group's scales and zeros are one vector per 16 rows.
 *
 * Layout (input channels in group order, as group_linear.c's): row group h = rows 16h..16h+15; per run j of 32
 * inputs one tile. 4-bit: 4 chunks of 64 bytes, chunk c's 32-bit word r holds row r's codes of inputs 8c..8c+7,
 * input 8c+p in bits 4p..4p+3 (a shift and a vpermps of the table {0..15} make 16 fp32 codes); 8-bit: 32 x 16
 * bytes, byte r of the 16 for input k is row r's code. Scales and zeros [out / 16, groups, 16].
 *
 * Builds (compile time, as packed_grouped.c's): "avx512_vnni" rounds the activations to int16 per run and takes
 * the integer dots with vpdpwssd (act_q16.h: extra activation rows cost about half an fp32 FMA path's; its
 * header states the rounding's bound, where d u is s u here); "avx512" (no VNNI+VBMI: Skylake-SP, Cascade Lake),
 * "avx2_vnni" and "avx2" (Zen 1-3, Haswell to Skylake client) take the same int16 runs and integer dots in two
 * 8-row halves (vpdpwssd ymm with AVX-VNNI, vpmaddwd + vpaddd without) with the same float epilogue: bit for bit
 * the avx512_vnni build's outputs. "portable" keeps fp32 activations:
 *
 * Numerics (portable): per run the codes are summed against fp32 activations as integers and scaled once,
 * y = sum over runs of s * sum(u x) + (-z s) * sum(x), as packed_grouped.c does for Q4_1. The weights (u - z) s
 * are never rounded, but the two parts are summed separately, so the fp32 error is relative to their magnitudes:
 * |y - x W^T| <= (in / 32 + 40) 2^-24 sum_k (u_k + z_k) s_k |x_k| per output (tests/test_group_kernel.py checks
 * this bound). The expansion (dequantize) stays bit exact.
 */
#include "isa.h"
#include <omp.h>
#include <stdlib.h>

#include "act_q16_dots.h"
#include "group_state.h"

#define GQ_PREFETCH_TILES 8  /* software prefetch distance, in tiles (packed_grouped.c's former choice; its 4 not measured here) */
#define GQ_INLINE static inline __attribute__((always_inline))
#if defined(PQ_LANES8)
#define GQ_GTILE 4  /* activation rows per pass: 16 ymm registers hold 2 R totals + 2 R (4 R at R <= 2) integer sums */
#else
#define GQ_GTILE 8  /* activation rows per pass over a row group's weights */
#endif

static inline int64_t gq_tile_bytes(int bits) { return 32 * GQ_ROWS * bits / 8; }

/* Row o's 32 codes of run j, in input order (portable; dequantize and the portable product). */
void gq_grouped_codes(const ps_group_state *st, int64_t o, int64_t j, uint8_t *u) {
    const int64_t runs = st->in_features / 32;
    const uint8_t *tile = st->codes + ((o / GQ_ROWS) * runs + j) * gq_tile_bytes(st->bits);
    const int r = (int)(o % GQ_ROWS);
    if (st->bits == 4) {
        pk_tile4_codes(tile, r, u);  /* the GGUF Q4 tile's code layout */
        return;
    }
    for (int k = 0; k < 32; k++) u[k] = tile[GQ_ROWS * k + r];
}

#if defined(PS_AVX512_VNNI)
/* The group's scale s and offset -z s (16 rows) for group g of row group h. -z s is exact for fp16 scales
 * (8 x 11 significant bits), as group_linear.c's offset. */
GQ_INLINE void gq_group_scales(const ps_group_state *st, int64_t h, int32_t g, __m512 *s, __m512 *m) {
    const int64_t at = (h * st->groups + g) * GQ_ROWS;
    const uint16_t *s16 = (const uint16_t *)st->scales + at;
    *s = st->scale_f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s16))
                       : _mm512_loadu_ps((const float *)st->scales + at);
    const __m128i z8 = _mm_loadu_si128((const __m128i *)(st->zeros + at));
    *m = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(z8))), *s);
}

#define GQ_GROUPED_ISA "avx512_vnni"

/* The 16 rows of row group h for R activation rows from their int16 runs: per run the integer dots (act_q16.h),
 * then tot += (s da) * dot + (-z s) * sum(x), the same instructions per row whatever R; the bias last. */
GQ_INLINE void gq_grouped_store(const ps_group_state *st, int bits, int64_t h, const float *x, pq_act act, int R,
                                float *y) {
    (void)x;
    const int64_t runs = st->in_features / 32, tb = gq_tile_bytes(bits);
    const uint8_t *tiles = st->codes + h * runs * tb;
    __m512 tot[GQ_GTILE], s = _mm512_setzero_ps(), m = s;
    for (int r = 0; r < R; r++) tot[r] = _mm512_setzero_ps();
    int32_t cur = -1;
    for (int64_t j = 0; j < runs; j++) {
        if (st->run_group[j] != cur) gq_group_scales(st, h, cur = st->run_group[j], &s, &m);
        const uint8_t *tile = tiles + j * tb;
        for (int64_t l = 0; l <= tb; l += 64) _mm_prefetch((const char *)tile + GQ_PREFETCH_TILES * tb + l, _MM_HINT_T0);
        __m512i acc[2 * GQ_GTILE];
        if (bits == 4) pq_dots4(tile, act.q + 32 * j, 32 * runs, R, acc);
        else pq_dots8(tile, 0, act.q + 32 * j, 32 * runs, R, acc);
        for (int r = 0; r < R; r++)
            tot[r] = pq_block_total(tot[r], acc[r], s, m, act.da[r * runs + j], act.sx[r * runs + j], 1);
    }
    const __m512 bias = st->bias ? _mm512_loadu_ps(st->bias + h * GQ_ROWS) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * st->out_features + h * GQ_ROWS, _mm512_add_ps(tot[r], bias));
}
#elif defined(PQ_LANES8)
#define GQ_GROUPED_ISA PQ_INT16

/* Half `half` (rows 8 half .. 8 half + 7) of group g of row group h: its scale s and offset -z s, as the AVX-512
 * form's (exact for fp16 scales). */
GQ_INLINE void gq_half_scales(const ps_group_state *st, int64_t h, int32_t g, int half, __m256 *s, __m256 *m) {
    const int64_t at = (h * st->groups + g) * GQ_ROWS + 8 * half;
    *s = st->scale_f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)st->scales + at)))
                       : _mm256_loadu_ps((const float *)st->scales + at);
    const __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(st->zeros + at))));
    *m = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), z), *s);
}

/* The avx512_vnni form in two 8-lane halves (rows 0-7: tot[2r], rows 8-15: tot[2r + 1]) with the same integer dots
 * and float epilogue per lane, so its outputs are that build's bit for bit. It replaced an fp32 FMA form (a shift,
 * mask, conversion and FMA per 8 codes and row) that ran the GPTQ/AWQ layers slower than Q4_1's int16 kernel. */
GQ_INLINE void gq_grouped_store(const ps_group_state *st, int bits, int64_t h, const float *x, pq_act act, int R,
                                float *y) {
    (void)x;
    const int64_t runs = st->in_features / 32, tb = gq_tile_bytes(bits);
    const uint8_t *tiles = st->codes + h * runs * tb;
    __m256 tot[2 * GQ_GTILE], s0 = _mm256_setzero_ps(), m0 = s0, s1 = s0, m1 = s0;
    for (int r = 0; r < 2 * R; r++) tot[r] = _mm256_setzero_ps();
    int32_t cur = -1;
    for (int64_t j = 0; j < runs; j++) {
        if (st->run_group[j] != cur) {
            cur = st->run_group[j];
            gq_half_scales(st, h, cur, 0, &s0, &m0);
            gq_half_scales(st, h, cur, 1, &s1, &m1);
        }
        const uint8_t *tile = tiles + j * tb;
        for (int64_t l = 0; l <= tb; l += 64) _mm_prefetch((const char *)tile + GQ_PREFETCH_TILES * tb + l, _MM_HINT_T0);
        __m256i acc[4 * GQ_GTILE];
        if (bits == 4) pq_dots4(tile, act.q + 32 * j, 32 * runs, R, acc);
        else pq_dots8(tile, 0, act.q + 32 * j, 32 * runs, R, acc);
        for (int r = 0; r < R; r++) {
            const float da = act.da[r * runs + j], sx = act.sx[r * runs + j];
            tot[2 * r] = pq_block_total8(tot[2 * r], acc[2 * r], s0, m0, da, sx, 1);
            tot[2 * r + 1] = pq_block_total8(tot[2 * r + 1], acc[2 * r + 1], s1, m1, da, sx, 1);
        }
    }
    const int64_t o = h * GQ_ROWS;
    const __m256 b0 = st->bias ? _mm256_loadu_ps(st->bias + o) : _mm256_setzero_ps();
    const __m256 b1 = st->bias ? _mm256_loadu_ps(st->bias + o + 8) : _mm256_setzero_ps();
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(y + r * st->out_features + o, _mm256_add_ps(tot[2 * r], b0));
        _mm256_storeu_ps(y + r * st->out_features + o + 8, _mm256_add_ps(tot[2 * r + 1], b1));
    }
}
#else
#define GQ_GROUPED_ISA "portable"
/* Exact weights w = u s + (-z s), as group_linear.c's portable path. */
static void gq_grouped_store(const ps_group_state *st, int bits, int64_t h, const float *x, pq_act act, int R,
                             float *y) {
    const int64_t in = st->in_features, runs = in / 32;
    (void)bits, (void)act;
    for (int64_t o = h * GQ_ROWS; o < (h + 1) * GQ_ROWS; o++) {
        for (int r = 0; r < R; r++) {
            float total = 0.0f;
            for (int64_t j = 0; j < runs; j++) {
                const int64_t at = gq_sz_index(st, o, st->run_group[j]);
                const float d = gq_scale(st, at), m = -(float)st->zeros[at] * d;
                uint8_t u[32];
                gq_grouped_codes(st, o, j, u);
                for (int k = 0; k < 32; k++) total += ((float)u[k] * d + m) * x[r * in + 32 * j + k];
            }
            y[r * st->out_features + o] = total + (st->bias ? st->bias[o] : 0.0f);
        }
    }
}
#endif

/* R <= GQ_GTILE; each R its own instance (constant loop bounds keep the sums in registers) */
#define GQ_CASE(B, R_) case R_: gq_grouped_store(st, B, h, x, act, R_, y); return;
#if GQ_GTILE > 4
#define GQ_MORE_CASES(B) GQ_CASE(B, 4) GQ_CASE(B, 5) GQ_CASE(B, 6) GQ_CASE(B, 7)
#else
#define GQ_MORE_CASES(B)
#endif
#define GQ_GROUPED_CASES(B)                                                                    \
    switch (R) {                                                                               \
    GQ_CASE(B, 1) GQ_CASE(B, 2) GQ_CASE(B, 3) GQ_MORE_CASES(B)                                 \
    default: gq_grouped_store(st, B, h, x, act, GQ_GTILE, y); return;                          \
    }

static void gq_grouped_any(const ps_group_state *st, int64_t h, const float *x, pq_act act, int R, float *y) {
    if (st->bits == 4) GQ_GROUPED_CASES(4)
    GQ_GROUPED_CASES(8)
}

/* y = x @ W^T (+ bias), x already in the weights' input order. Returns 0, or 2 when out of memory. */
int gq_grouped_product(const ps_group_state *st, const float *x, int64_t rows, float *y, int threads) {
    const int64_t in = st->in_features, runs = in / 32;
    pq_act act;  /* per run sums (and int16 runs) of each activation row */
    if (pq_alloc(&act, rows, runs)) return 2;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) pq_quantize(x, runs, r, r + 1, st->bits == 4, &act);
#pragma omp for schedule(static)
        for (int64_t h = 0; h < st->out_features / GQ_ROWS; h++) {
            for (int64_t r0 = 0; r0 < rows; r0 += GQ_GTILE) {
                const int R = rows - r0 < GQ_GTILE ? (int)(rows - r0) : GQ_GTILE;
                gq_grouped_any(st, h, x + r0 * in, pq_rows(&act, r0, runs), R, y + r0 * st->out_features);
            }
        }
    }
    pq_free(&act);
    return 0;
}

const char *pagedserve_group_grouped_isa(void) __attribute__((visibility("default")));
const char *pagedserve_group_grouped_isa(void) { return GQ_GROUPED_ISA; }
