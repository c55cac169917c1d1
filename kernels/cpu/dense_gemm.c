/* The grouped bf16 layout (dense_grouped.c) at any number of activation rows: prefill and decode batches past the
 * GEMV's eight, read straight from the weight the GEMV reads, so no call rewrites the matrix row-major or widens it
 * to fp32 (what F.linear on it needed: a temporary per slice, and oneDNN's own reorder after it).
 *
 * Paths, best first (pagedserve_dense_gemm_isa names the one a call takes):
 *   bf16 compute  AMX tiles where granted (dense_amx.c); else AVX512-BF16 vdpbf16ps, one instruction per input
 *                 pair of 16 outputs; else the fp32 path over x rounded to bf16.
 *   fp32 compute  (x_fp32: 16-bit weights of an fp32 model) FMAs over weights widened exactly in registers, the
 *                 GEMV's even/odd chains in its order, so its outputs equal the GEMV's bit for bit.
 * Blocking (both register-tiled paths): each thread owns a run of groups; activation rows go in blocks of about 1 MB
 * (kept in L2 while the thread's groups pass over them), and a group's panel is reused from L2 by every row tile of
 * the block: compute-bound at the FMA rate instead of re-reading the weights from memory every few rows. Each
 * output is one fixed-order sum over the inputs, whatever the number of rows beside it.
 */
#include "isa.h"
#include "dense_linear.h"
#include "native.h"
#include <omp.h>

enum { X_BLOCK_BYTES = 1 << 20 };

void ps_dense_emit(const DenseLinear *s, const float *c, int64_t r0, int64_t n, int64_t col0, void *y, int y_dtype) {
    const int64_t out = s->out_features;
    const f32x16 bias = s->bias ? load16((const char *)s->bias + col0 * elem_size(s->bias_dtype), 0, s->bias_dtype)
                                : (f32x16){0};
    for (int64_t r = 0; r < n; r++) {
        f32x16 v;
        memcpy(&v, c + 16 * r, sizeof v);
        if (s->bias) v += bias;
        store16((char *)y + ((r0 + r) * out + col0) * elem_size(y_dtype), 0, y_dtype, v);
    }
}

/* A panel: groups [g0, g0 + ng) (ng <= the path's) x activation rows [r0, r0 + nr), written to y. */
typedef void (*panel_fn)(const DenseLinear *s, const void *x, int64_t g0, int ng, int64_t r0, int64_t nr, void *y,
                         int y_dtype);

#if defined(PS_AVX512)
enum { FR = 6, FG = 2 };  /* fp32 tile: rows x groups; 2 x 12 accumulators + 4 widened weight registers */

INLINE void f32_tile(const uint32_t *w, int64_t gwords, int64_t pairs, const float *x, int64_t in, float *c,
                     const int R, const int NG) {
    __m512 even[FR * FG], odd[FR * FG];
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < NG * R; i++) even[i] = odd[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        for (int n = 0; n < NG; n++) {
            const __m512i v = _mm512_loadu_si512(w + n * gwords + p * DENSE_GROUP_ROWS);
            const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, high));
            for (int r = 0; r < R; r++) {  /* the GEMV's chains: fma(w, x, acc), even and odd inputs apart */
                even[n * R + r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(x[r * in + 2 * p]), even[n * R + r]);
                odd[n * R + r] = _mm512_fmadd_ps(hi, _mm512_set1_ps(x[r * in + 2 * p + 1]), odd[n * R + r]);
            }
        }
    }
    for (int n = 0; n < NG; n++)
        for (int r = 0; r < R; r++) _mm512_storeu_ps(c + (n * FR + r) * 16, _mm512_add_ps(even[n * R + r], odd[n * R + r]));
}
#elif defined(PS_AVX2)
enum { FR = 6, FG = 1 };  /* fp32 tile over half a group (8 lanes): 12 accumulators + 2 weights + a broadcast */

INLINE void f32_half(const uint32_t *w, int64_t pairs, int half, const float *x, int64_t in, float *c, const int R) {
    __m256 even[FR], odd[FR];
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int r = 0; r < R; r++) even[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + p * DENSE_GROUP_ROWS + 8 * half));
        const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        for (int r = 0; r < R; r++) {
            even[r] = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(x + r * in + 2 * p), even[r]);
            odd[r] = _mm256_fmadd_ps(hi, _mm256_broadcast_ss(x + r * in + 2 * p + 1), odd[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(c + r * 16 + 8 * half, _mm256_add_ps(even[r], odd[r]));
}

INLINE void f32_tile(const uint32_t *w, int64_t gwords, int64_t pairs, const float *x, int64_t in, float *c,
                     const int R, const int NG) {
    (void)gwords, (void)NG;
    f32_half(w, pairs, 0, x, in, c, R);
    f32_half(w, pairs, 1, x, in, c, R);
}
#endif

#if defined(PS_AVX2)
#define F32_CASE(R)                                                                                 \
    case R: if (ng == 2) f32_tile(wg, gwords, pairs, xr, in, c, R, FG);                             \
            else f32_tile(wg, gwords, pairs, xr, in, c, R, 1);                                      \
            break;

static void f32_panel(const DenseLinear *s, const void *x, int64_t g0, int ng, int64_t r0, int64_t nr, void *y,
                      int y_dtype) {
    const int64_t in = s->in_features, pairs = in / 2, gwords = pairs * DENSE_GROUP_ROWS;
    const uint32_t *wg = (const uint32_t *)s->weight + g0 * gwords;
    float c[FG * FR * 16] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r0 + nr; r += FR) {
        const float *xr = (const float *)x + r * in;
        const int R = r0 + nr - r < FR ? (int)(r0 + nr - r) : FR;
        switch (R) { F32_CASE(1) F32_CASE(2) F32_CASE(3) F32_CASE(4) F32_CASE(5) F32_CASE(6) }
        for (int n = 0; n < ng; n++) ps_dense_emit(s, c + n * FR * 16, r, R, (g0 + n) * 16, y, y_dtype);
    }
}
#endif

#if defined(PS_AVX512_BF16)
enum { BR = 12, BG = 2 };  /* vdpbf16ps tile: rows x groups, 24 accumulators */

INLINE void bf16_tile(const uint32_t *w, int64_t gwords, int64_t pairs, const uint32_t *xw, int64_t xpairs, float *c,
                      const int R, const int NG) {
    __m512 acc[BR * BG];
    for (int i = 0; i < NG * R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++)
        for (int n = 0; n < NG; n++) {
            const __m512bh v = (__m512bh)_mm512_loadu_si512(w + n * gwords + p * DENSE_GROUP_ROWS);
            for (int r = 0; r < R; r++)
                acc[n * R + r] = _mm512_dpbf16_ps(acc[n * R + r], v, (__m512bh)_mm512_set1_epi32((int)xw[r * xpairs + p]));
        }
    for (int n = 0; n < NG; n++)
        for (int r = 0; r < R; r++) _mm512_storeu_ps(c + (n * BR + r) * 16, acc[n * R + r]);
}

#define BF16_CASE(R)                                                                                \
    case R: if (ng == 2) bf16_tile(wg, gwords, pairs, xw, pairs, c, R, BG);                         \
            else bf16_tile(wg, gwords, pairs, xw, pairs, c, R, 1);                                  \
            break;

static void bf16_panel(const DenseLinear *s, const void *x, int64_t g0, int ng, int64_t r0, int64_t nr, void *y,
                       int y_dtype) {
    const int64_t pairs = s->in_features / 2, gwords = pairs * DENSE_GROUP_ROWS;
    const uint32_t *wg = (const uint32_t *)s->weight + g0 * gwords;
    float c[BG * BR * 16] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r0 + nr; r += BR) {
        const uint32_t *xw = (const uint32_t *)x + r * pairs;
        const int R = r0 + nr - r < BR ? (int)(r0 + nr - r) : BR;
        switch (R) {
            BF16_CASE(1) BF16_CASE(2) BF16_CASE(3) BF16_CASE(4) BF16_CASE(5) BF16_CASE(6)
            BF16_CASE(7) BF16_CASE(8) BF16_CASE(9) BF16_CASE(10) BF16_CASE(11) BF16_CASE(12)
        }
        for (int n = 0; n < ng; n++) ps_dense_emit(s, c + n * BR * 16, r, R, (g0 + n) * 16, y, y_dtype);
    }
}
#endif

#if defined(PS_AVX2)
/* Threads own runs of `ng`-group units; rows go in blocks of `block` (a multiple of the tile's rows). */
static void drive(const DenseLinear *s, const void *x, int64_t rows, int64_t block, int ng, panel_fn panel, void *y,
                  int y_dtype) {
    const int64_t groups = s->out_features / DENSE_GROUP_ROWS, units = (groups + ng - 1) / ng;
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        for (int64_t m0 = 0; m0 < rows; m0 += block)
            for (int64_t u = units * t / nt; u < units * (t + 1) / nt; u++) {
                const int64_t g0 = u * ng;
                panel(s, x, g0, groups - g0 < ng ? (int)(groups - g0) : ng, m0, rows - m0 < block ? rows - m0 : block,
                      y, y_dtype);
            }
    }
}

/* Rows of `block_rows` x elements of `bytes` each, about X_BLOCK_BYTES, a multiple of `tile` rows. */
static int64_t row_block(int64_t in, int64_t bytes, int64_t tile) {
    const int64_t rows = X_BLOCK_BYTES / (in * bytes) / tile * tile;
    return rows < 4 * tile ? 4 * tile : rows;
}

/* x as the kernels read it: bf16 rows [rows_pad, kpad] zero-padded (AMX: rows_pad = rows rounded up to 16), or fp32
 * rows rounded to bf16 first unless `exact`; NULL when x is already that. `*fresh`: the caller frees it. */
static void *prepared(const void *x, int x_dtype, int64_t rows, int64_t in, int want, int64_t rows_pad, int64_t kpad,
                      int exact, int *fresh) {
    *fresh = 0;
    if (want == DT_BF16 ? x_dtype == DT_BF16 && rows_pad == rows && kpad == in : x_dtype == DT_F32 && exact)
        return (void *)x;
    void *buf = aligned_alloc(64, (size_t)((rows_pad * kpad * elem_size(want) + 63) / 64) * 64);
    if (!buf) return NULL;
    *fresh = 1;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows_pad; r++)
        for (int64_t k = 0; k < kpad; k++) {
            float v = r < rows && k < in ? load_at(x, r * in + k, x_dtype) : 0.0f;
            if (!exact) v = bf16_to_f32(f32_to_bf16(v));
            store_at(buf, r * kpad + k, want, v);
        }
    return buf;
}
#endif

int pagedserve_dense_gemm(const void *state, const void *x, int x_dtype, int64_t rows, void *y, int y_dtype,
                          int allow_amx) {
    const DenseLinear *s = state;
    if (!s || !x || !y || rows < 0 || (x_dtype != DT_F32 && x_dtype != DT_BF16) ||
        (y_dtype != DT_F32 && y_dtype != DT_BF16))
        return -1;
    if (s->row_group != DENSE_GROUP_ROWS || s->w_dtype != DT_BF16 || s->in_features % 2 ||
        s->out_features % DENSE_GROUP_ROWS)
        return -3;
#if defined(PS_AVX2)
    const int64_t in = s->in_features;
    int fresh;
    void *xs;
    if (rows == 0) return 0;
    if (!s->x_fp32 && allow_amx && ps_amx_ready()) {
        const int64_t kpad = (in + 31) / 32 * 32;
        if (!(xs = prepared(x, x_dtype, rows, in, DT_BF16, (rows + 15) / 16 * 16, kpad, 0, &fresh))) return -2;
        const int status = ps_dense_amx(s, xs, kpad, rows, y, y_dtype);
        if (fresh) free(xs);
        return status;
    }
#if defined(PS_AVX512_BF16)
    if (!s->x_fp32) {
        if (!(xs = prepared(x, x_dtype, rows, in, DT_BF16, rows, in, 0, &fresh))) return -2;
        drive(s, xs, rows, row_block(in, 2, BR), BG, bf16_panel, y, y_dtype);
        if (fresh) free(xs);
        return 0;
    }
#endif
    if (!(xs = prepared(x, x_dtype, rows, in, DT_F32, rows, in, s->x_fp32, &fresh))) return -2;
    drive(s, xs, rows, row_block(in, 4, FR), FG, f32_panel, y, y_dtype);
    if (fresh) free(xs);
    return 0;
#else
    (void)allow_amx;
    return rows == 0 ? 0 : 1;  /* no grouped layout in builds without AVX2 */
#endif
}

/* The path a call takes: bf16 compute (x_fp32 0) with AMX allowed, or fp32 compute. */
const char *pagedserve_dense_gemm_isa(int x_fp32, int allow_amx) {
    if (!x_fp32 && allow_amx && ps_amx_ready()) return "amx";
#if defined(PS_AVX512_BF16)
    if (!x_fp32) return "avx512_bf16";
#endif
#if defined(PS_AVX512)
    return "avx512";
#elif defined(PS_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}
