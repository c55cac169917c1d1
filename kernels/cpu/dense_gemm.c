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

/* A panel: groups [g0, g0 + ng) (ng <= the path's) x activation rows [r0, r0 + nr) (r0 a multiple of the tile's
 * rows) of x packed by pack_rows, written to y. */
typedef void (*panel_fn)(const DenseLinear *s, const void *xp, int64_t g0, int ng, int64_t r0, int64_t nr, void *y,
                         int y_dtype);

#if defined(PS_AVX512)
enum { FR = 4, FG = 2 };  /* fp32 tile: rows x groups: 16 accumulators, 8 broadcasts, 4 widened weights */

/* xp: one packed row tile, per input pair p the FR rows' (even, odd) inputs side by side. */
INLINE void f32_tile(const uint32_t *w, int64_t gwords, int64_t pairs, const float *xp, float *c, const int NG) {
    __m512 even[FR * FG], odd[FR * FG];
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < NG * FR; i++) even[i] = odd[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++, xp += 2 * FR) {
        for (int n = 0; n < NG; n++) {
            const __m512i v = _mm512_loadu_si512(w + n * gwords + p * DENSE_GROUP_ROWS);
            const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, high));
            for (int r = 0; r < FR; r++) {  /* the GEMV's chains: fma(w, x, acc), even and odd inputs apart */
                even[n * FR + r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xp[2 * r]), even[n * FR + r]);
                odd[n * FR + r] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xp[2 * r + 1]), odd[n * FR + r]);
            }
        }
    }
    for (int i = 0; i < NG * FR; i++) _mm512_storeu_ps(c + 16 * i, _mm512_add_ps(even[i], odd[i]));
}
#elif defined(PS_AVX2)
enum { FR = 6, FG = 1 };  /* fp32 tile over half a group (8 lanes): 12 accumulators + 2 weights + a broadcast */

INLINE void f32_half(const uint32_t *w, int64_t pairs, int half, const float *xp, float *c) {
    __m256 even[FR], odd[FR];
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int r = 0; r < FR; r++) even[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; p++, xp += 2 * FR) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + p * DENSE_GROUP_ROWS + 8 * half));
        const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        for (int r = 0; r < FR; r++) {
            even[r] = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(xp + 2 * r), even[r]);
            odd[r] = _mm256_fmadd_ps(hi, _mm256_broadcast_ss(xp + 2 * r + 1), odd[r]);
        }
    }
    for (int r = 0; r < FR; r++) _mm256_storeu_ps(c + r * 16 + 8 * half, _mm256_add_ps(even[r], odd[r]));
}

INLINE void f32_tile(const uint32_t *w, int64_t gwords, int64_t pairs, const float *xp, float *c, const int NG) {
    (void)gwords, (void)NG;
    f32_half(w, pairs, 0, xp, c);
    f32_half(w, pairs, 1, xp, c);
}
#endif

#if defined(PS_AVX2)
static void f32_panel(const DenseLinear *s, const void *xp, int64_t g0, int ng, int64_t r0, int64_t nr, void *y,
                      int y_dtype) {
    const int64_t pairs = s->in_features / 2, gwords = pairs * DENSE_GROUP_ROWS;
    const uint32_t *wg = (const uint32_t *)s->weight + g0 * gwords;
    float c[FG * FR * 16] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r0 + nr; r += FR) {
        const float *xt = (const float *)xp + r * 2 * pairs;
        if (ng == 2) f32_tile(wg, gwords, pairs, xt, c, FG);
        else f32_tile(wg, gwords, pairs, xt, c, 1);
        for (int n = 0; n < ng; n++)
            ps_dense_emit(s, c + n * FR * 16, r, r0 + nr - r < FR ? r0 + nr - r : FR, (g0 + n) * 16, y, y_dtype);
    }
}
#endif

#if defined(PS_AVX512_BF16)
enum { BR = 8, BG = 2 };  /* vdpbf16ps tile: rows x groups: 16 accumulators, 8 broadcasts (shared by the groups) */

/* xw: one packed row tile, per input pair the BR rows' bf16 pairs side by side. */
INLINE void bf16_tile(const uint32_t *w, int64_t gwords, int64_t pairs, const uint32_t *xw, float *c, const int NG) {
    __m512 acc[BR * BG];
    for (int i = 0; i < NG * BR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++, xw += BR)
        for (int n = 0; n < NG; n++) {
            const __m512bh v = (__m512bh)_mm512_loadu_si512(w + n * gwords + p * DENSE_GROUP_ROWS);
            for (int r = 0; r < BR; r++)
                acc[n * BR + r] = _mm512_dpbf16_ps(acc[n * BR + r], v, (__m512bh)_mm512_set1_epi32((int)xw[r]));
        }
    for (int i = 0; i < NG * BR; i++) _mm512_storeu_ps(c + 16 * i, acc[i]);
}

static void bf16_panel(const DenseLinear *s, const void *xp, int64_t g0, int ng, int64_t r0, int64_t nr, void *y,
                       int y_dtype) {
    const int64_t pairs = s->in_features / 2, gwords = pairs * DENSE_GROUP_ROWS;
    const uint32_t *wg = (const uint32_t *)s->weight + g0 * gwords;
    float c[BG * BR * 16] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r0 + nr; r += BR) {
        const uint32_t *xt = (const uint32_t *)xp + r * pairs;
        if (ng == 2) bf16_tile(wg, gwords, pairs, xt, c, BG);
        else bf16_tile(wg, gwords, pairs, xt, c, 1);
        for (int n = 0; n < ng; n++)
            ps_dense_emit(s, c + n * BR * 16, r, r0 + nr - r < BR ? r0 + nr - r : BR, (g0 + n) * 16, y, y_dtype);
    }
}
#endif

#if defined(PS_AVX2)
/* Threads own runs of `ng`-group units; rows go in blocks of `block` (a multiple of the tile's rows). */
static void drive(const DenseLinear *s, const void *xp, int64_t rows, int64_t block, int ng, panel_fn panel, void *y,
                  int y_dtype) {
    const int64_t groups = s->out_features / DENSE_GROUP_ROWS, units = (groups + ng - 1) / ng;
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        for (int64_t m0 = 0; m0 < rows; m0 += block)
            for (int64_t u = units * t / nt; u < units * (t + 1) / nt; u++) {
                const int64_t g0 = u * ng;
                panel(s, xp, g0, groups - g0 < ng ? (int)(groups - g0) : ng, m0, rows - m0 < block ? rows - m0 : block,
                      y, y_dtype);
            }
    }
}

/* Rows per block: about X_BLOCK_BYTES of packed x, a multiple of `tile` rows. */
static int64_t row_block(int64_t in, int64_t bytes, int64_t tile) {
    const int64_t rows = X_BLOCK_BYTES / (in * bytes) / tile * tile;
    return rows < 4 * tile ? 4 * tile : rows;
}

/* pack_rows for bf16 x into bf16 pairs: each run of a row is a copy of up to `run` 32-bit words (one pair each),
 * zero past the input and in the padding rows. Decode-sized copies stay on one thread: a parallel region costs
 * more than they do. */
static void copy_runs(const void *x, int64_t rows, int64_t in, int64_t tile, int64_t run, void *buf) {
    const int64_t tiles = (rows + tile - 1) / tile, runs = (in / 2 + run - 1) / run, pairs = in / 2;
    const uint32_t *xw = x;
    uint32_t *out = buf;
#pragma omp parallel for schedule(static) if (tiles * tile * in >= (1 << 18))
    for (int64_t tr = 0; tr < tiles * tile; tr++) {
        const int64_t t = tr / tile, r = tr % tile;
        for (int64_t q = 0; q < runs; q++) {
            uint32_t *to = out + ((t * runs + q) * tile + r) * run;
            const uint32_t *from = xw + tr * pairs + q * run;
            const int64_t n = tr < rows ? (pairs - q * run < run ? pairs - q * run : run) : 0;
            for (int64_t i = 0; i < run; i++) to[i] = i < n ? from[i] : 0;
        }
    }
}

/* x packed for the tiles: tiles of `tile` rows (the last padded with zero rows), in each, runs of `run` input pairs
 * (the input padded with zero pairs to a multiple of `run`) with the tile's rows one after another: pair p of row r
 * of tile t at ((t * runs + p / run) * tile + r) * run + p % run. A pair is two bf16 (want DT_BF16) or two fp32,
 * rounded to bf16 unless `exact`. Rows side by side keep a tile's loads in one stream, not one per row (rows of
 * 4 or 8 KB fall in one L1 set). */
static void *pack_rows(const void *x, int x_dtype, int64_t rows, int64_t in, int64_t tile, int64_t run, int want,
                       int exact) {
    const int64_t tiles = (rows + tile - 1) / tile, runs = (in / 2 + run - 1) / run, pairs = runs * run;
    void *buf = aligned_alloc(64, (size_t)((tiles * tile * pairs * 2 * elem_size(want) + 63) / 64) * 64);
    if (!buf) return NULL;
    if (x_dtype == DT_BF16 && want == DT_BF16) {  /* a run of a row is whole bf16 pairs of x as they are */
        copy_runs(x, rows, in, tile, run, buf);
        return buf;
    }
#pragma omp parallel for schedule(static)
    for (int64_t tr = 0; tr < tiles * tile; tr++) {
        const int64_t t = tr / tile, r = tr % tile;
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t at = 2 * (((t * runs + p / run) * tile + r) * run + p % run);
            for (int h = 0; h < 2; h++) {
                float v = tr < rows && 2 * p < in ? load_at(x, tr * in + 2 * p + h, x_dtype) : 0.0f;
                store_at(buf, at + h, want, exact ? v : bf16_to_f32(f32_to_bf16(v)));
            }
        }
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
    void *xp;
    if (rows == 0) return 0;
    if (!s->x_fp32 && allow_amx && ps_amx_ready()) {
        const int direct = x_dtype == DT_BF16 ? ps_dense_amx_rows(s, x, rows, y, y_dtype) : 1;
        if (direct != 1) return direct;
        if (!(xp = pack_rows(x, x_dtype, rows, in, 16, 16, DT_BF16, 0))) return -2;
        const int status = ps_dense_amx(s, xp, rows, y, y_dtype);
        free(xp);
        return status;
    }
#if defined(PS_AVX512_BF16)
    if (!s->x_fp32) {
        if (!(xp = pack_rows(x, x_dtype, rows, in, BR, 1, DT_BF16, 0))) return -2;
        drive(s, xp, rows, row_block(in, 2, BR), BG, bf16_panel, y, y_dtype);
        free(xp);
        return 0;
    }
#endif
    if (!(xp = pack_rows(x, x_dtype, rows, in, FR, 1, DT_F32, s->x_fp32))) return -2;
    drive(s, xp, rows, row_block(in, 4, FR), FG, f32_panel, y, y_dtype);
    free(xp);
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
