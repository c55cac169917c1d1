/* The dense (unquantized) linear layer of the native small-batch path: y[rows, out] = x[rows, in] @ W^T + bias with
 * W [out, in] row-major in bf16, fp16 or fp32, as a ps_linear_fn (kernels/cpu/linear.h; state built by
 * quant/dense_native.py).
 *
 * Why: at 1-8 rows a linear layer is a matrix-vector product bound by reading W once; oneDNN's packed GEMM spends
 * ~60-80 us per call on setup at decode sizes (measured 216 us for a 3.5 MB bf16 weight, ~16 GB/s). Here each
 * thread streams its share of W's rows once and multiplies every x row against each weight chunk while it is in
 * registers.
 *
 * Numerics: x is rounded to W's dtype first (as the torch path, whose activations are already in that dtype),
 * unless the layer holds 16-bit weights for fp32 compute (x_fp32: a host without bf16 arithmetic, where the
 * weights are only widened, exactly, in registers); products are exact in fp32 and summed in fp32; only the order of the sums differs from oneDNN's. With
 * AVX512-BF16, bf16 weights use vdpbf16ps (pairs of bf16 products into fp32 lanes); elsewhere the portable
 * 16-lane code computes the same products.
 *
 * bf16 matrices with rows interleaved in groups of 16 at load (DenseLinear.row_group, AVX-512 builds) go to
 * dense_grouped.c instead: the same rounding of x and exact products, 1.3-2.6x faster at 1-8 rows.
 */
#include "isa.h"
#include "dense_linear.h"
#include "linear.h"
#include "native.h"

enum { MAX_ROWS = 8, ROW_BLOCK = 4 };  /* x rows per pass over a weight row block; output rows per block */

/* x rows rounded to dtype dt and widened back to fp32 (portable path): what the products read. */
static void round_rows(const float *x, int64_t n, int dt, float *out) {
    if (dt == DT_BF16) for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(f32_to_bf16(x[i]));
    else if (dt == DT_F16) for (int64_t i = 0; i < n; i++) out[i] = (float)(_Float16)x[i];
    else memcpy(out, x, sizeof(float) * n);
}

/* ROW_BLOCK output rows from o0, against `m` x rows: 16-lane fp32 sums, one per (output row, x row). */
INLINE void block_portable(const DenseLinear *s, const float *xr, int64_t m, int64_t o0, int64_t nrows, float *y,
                           const int dt) {
    const int64_t in = s->in_features, chunks = in / 16;
    for (int64_t j = 0; j < nrows; j++) {
        const void *w = (const char *)s->weight + (o0 + j) * in * elem_size(dt);
        f32x16 acc[MAX_ROWS];
        for (int64_t r = 0; r < m; r++) acc[r] = (f32x16){0};
        for (int64_t c = 0; c < chunks; c++) {
            const f32x16 wv = load16(w, c, dt);
            for (int64_t r = 0; r < m; r++) {
                f32x16 xv;
                memcpy(&xv, xr + r * in + 16 * c, sizeof xv);
                acc[r] += wv * xv;
            }
        }
        for (int64_t r = 0; r < m; r++) {
            float sum = hsum16(acc[r]);
            for (int64_t k = 16 * chunks; k < in; k++) sum += load_at(w, k, dt) * xr[r * in + k];
            y[r * s->out_features + o0 + j] = sum;
        }
    }
}

#if defined(PS_AVX512_BF16)
/* bf16 weights, in % 32 == 0, x rows pre-converted to bf16: `nrows` (<= ROW_BLOCK) output rows against M x rows,
 * M a constant (1..4) so the ROW_BLOCK x M accumulators stay in registers. */
INLINE void tile_bf16(const DenseLinear *s, const uint16_t *xb, int64_t o0, int64_t nrows, float *y, const int M) {
    const int64_t in = s->in_features, steps = in / 32;
    const uint16_t *w = (const uint16_t *)s->weight + o0 * in;
    __m512 acc[ROW_BLOCK][4];
    for (int j = 0; j < ROW_BLOCK; j++)
        for (int r = 0; r < M; r++) acc[j][r] = _mm512_setzero_ps();
    if (nrows == ROW_BLOCK) {
        for (int64_t k = 0; k < steps; k++) {
            __m512bh xv[4];
            for (int r = 0; r < M; r++) xv[r] = (__m512bh)_mm512_loadu_si512(xb + r * in + 32 * k);
            for (int j = 0; j < ROW_BLOCK; j++) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * in + 32 * k);
                for (int r = 0; r < M; r++) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], wv, xv[r]);
            }
        }
    } else {
        for (int64_t j = 0; j < nrows; j++)
            for (int64_t k = 0; k < steps; k++) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * in + 32 * k);
                for (int r = 0; r < M; r++)
                    acc[j][r] = _mm512_dpbf16_ps(acc[j][r], wv, (__m512bh)_mm512_loadu_si512(xb + r * in + 32 * k));
            }
    }
    for (int64_t j = 0; j < nrows; j++)
        for (int r = 0; r < M; r++) y[r * s->out_features + o0 + j] = _mm512_reduce_add_ps(acc[j][r]);
}

/* All m <= MAX_ROWS x rows in tiles of up to 4; the weight block stays in L1 between tiles. */
static void block_bf16(const DenseLinear *s, const uint16_t *xb, int64_t m, int64_t o0, int64_t nrows, float *y) {
    const int64_t in = s->in_features;
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const uint16_t *x = xb + r0 * in;
        float *yr = y + r0 * s->out_features;
        switch (m - r0 < 4 ? m - r0 : 4) {
            case 1: tile_bf16(s, x, o0, nrows, yr, 1); break;
            case 2: tile_bf16(s, x, o0, nrows, yr, 2); break;
            case 3: tile_bf16(s, x, o0, nrows, yr, 3); break;
            default: tile_bf16(s, x, o0, nrows, yr, 4); break;
        }
    }
}

static int bf16_fast(const DenseLinear *s) {
    return s->w_dtype == DT_BF16 && !s->x_fp32 && s->in_features % 32 == 0;
}

static void to_bf16_rows(const float *x, int64_t n, uint16_t *out) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        f32x16 v;
        memcpy(&v, x + i, sizeof v);
        const u16x16 bits = bf16x16_bits(v);
        memcpy(out + i, &bits, sizeof bits);
    }
    for (; i < n; i++) out[i] = f32_to_bf16(x[i]);
}
#else
static int bf16_fast(const DenseLinear *s) { (void)s; return 0; }
#endif

/* One pass of up to MAX_ROWS x rows (already rounded or converted in `xr`) over every output row. */
static void pass(const DenseLinear *s, const void *xr, int64_t m, float *y, int fast) {
    const int64_t blocks = (s->out_features + ROW_BLOCK - 1) / ROW_BLOCK;
    const int dt = s->w_dtype;
#pragma omp parallel for schedule(static) if (blocks > 8)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t o0 = b * ROW_BLOCK, left = s->out_features - o0;
        const int64_t nrows = left < ROW_BLOCK ? left : ROW_BLOCK;
#if defined(PS_AVX512_BF16)
        if (fast) { block_bf16(s, (const uint16_t *)xr, m, o0, nrows, y); continue; }
#endif
        (void)fast;
        if (dt == DT_BF16) block_portable(s, xr, m, o0, nrows, y, DT_BF16);
        else if (dt == DT_F16) block_portable(s, xr, m, o0, nrows, y, DT_F16);
        else block_portable(s, xr, m, o0, nrows, y, DT_F32);
    }
}

static void add_bias(const DenseLinear *s, int64_t rows, float *y) {
    const int64_t out = s->out_features;
    if (s->bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = 0; o < out; o++) y[r * out + o] += load_at(s->bias, o, s->bias_dtype);
}

int pagedserve_dense_linear(const void *state, const float *x, int64_t rows, float *y) {
    const DenseLinear *s = state;
    if (!s || !x || !y || rows < 0) return -1;
    const int64_t in = s->in_features, out = s->out_features;
    if (s->row_group) {  /* rows interleaved at load where this build has the grouped kernel (dense_grouped.c) */
        const int status = ps_dense_grouped(s, x, rows, y);
        if (status) return status < 0 ? status : -3;
        add_bias(s, rows, y);
        return 0;
    }
    const int fast = bf16_fast(s);
    void *xr = scratch(MAX_ROWS * in);
    if (!xr) return -2;
    for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        const int64_t m = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
#if defined(PS_AVX512_BF16)
        if (fast) to_bf16_rows(x + r0 * in, m * in, xr);
        else
#endif
            round_rows(x + r0 * in, m * in, s->x_fp32 ? DT_F32 : s->w_dtype, xr);
        pass(s, xr, m, y + r0 * out, fast);
    }
    free(xr);
    add_bias(s, rows, y);
    return 0;
}

/* For tests: the portable path whatever the CPU has (what a host without AVX512-BF16 runs). */
int pagedserve_dense_linear_portable(const void *state, const float *x, int64_t rows, float *y) {
    const DenseLinear *s = state;
    if (!s || !x || !y || rows < 0 || s->row_group) return -1;  /* the grouped layout has no portable kernel */
    const int64_t in = s->in_features, out = s->out_features;
    float *xr = scratch(MAX_ROWS * in);
    if (!xr) return -2;
    for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        const int64_t m = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
        round_rows(x + r0 * in, m * in, s->x_fp32 ? DT_F32 : s->w_dtype, xr);
        pass(s, xr, m, y + r0 * out, 0);
    }
    free(xr);
    add_bias(s, rows, y);
    return 0;
}

PS_SIZEOF(dense_linear, DenseLinear)
