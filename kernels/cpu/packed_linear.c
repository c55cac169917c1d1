/* y[rows, out] = x[rows, in] @ W^T with W in GGUF blocks, read in place (packed_blocks.h): the ps_linear_fn of
 * kernels/cpu/linear.h for packed weights.
 *
 * Activations are quantized per 32 values to int8 (x ~ a * q, a = max|x| / 127, as llama.cpp's Q8 activations), so
 * each run of 32 weights costs one u8 x s8 integer dot: vpdpbusd where the compiler targets AVX512-VNNI (with VL)
 * or AVX-VNNI, vpmaddubsw + vpmaddwd on plain AVX2, and C loops elsewhere. Compile-time choice: the object is built
 * with -march=native, and the tests build the other variants with features switched off.
 * Work splits over output rows (OpenMP on torch's pool); each weight run is unpacked once for up to 4 activation
 * rows, so small batches read the weights once. */
#include "isa.h"
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "linear.h"
#include "packed_blocks.h"

#define PK_EXPORT __attribute__((visibility("default")))
#define PK_INLINE static inline __attribute__((always_inline))
#define PK_TILE 4      /* activation rows sharing one unpacked weight run (int8 variant) */
#define PK_F32_TILE 8  /* the same for the fp32 variant (packed_f32.c) */
#define PK_CHUNK 16    /* output rows per unit of parallel work */


int pk_grouped_linear(const ps_packed_state *st, const float *x, int64_t rows, float *y, int threads);
void pk_f32_row_dot_any(int fmt, const uint8_t *w, int64_t nblocks, const float *x, int64_t in, int R, float *out);

/* One quantized activation row: codes per run of 32, the run's scale a, and a * sum(codes) of each 16-value half
 * (slo, shi) and of the whole run (sall). */
typedef struct {
    const int8_t *q;
    const float *a, *slo, *shi, *sall;
} pk_act;

#if defined(PS_AVX512_VNNI)
#define PK_ISA "avx512_vnni"
PK_INLINE __m256i pk_dot(__m256i u, __m256i q, int wide) {
    (void)wide;
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q);
}
#elif defined(PS_AVX2_VNNI)
#define PK_ISA "avx2_vnni"
PK_INLINE __m256i pk_dot(__m256i u, __m256i q, int wide) {
    (void)wide;
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, q);
}
#elif defined(PS_AVX2)
#define PK_ISA "avx2"
/* vpmaddubsw saturates pairs at 16 bits: codes >= 128 (Q8_0's) are split into nibbles first. */
PK_INLINE __m256i pk_dot(__m256i u, __m256i q, int wide) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (!wide) return _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), ones);
    const __m256i low4 = _mm256_set1_epi8(0xF);
    __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(u, low4), q), ones);
    __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(u, 4), low4), q), ones);
    return _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4));
}
#else
#define PK_ISA "portable"
#endif

#define PK_SEG 64  /* runs whose offsets m are kept for one vectorized dot with the activations' sums */

static inline float pk_fdot(const float *u, const float *v, int64_t n) {
    int64_t i = 0;
    float sum = 0.0f;
#if defined(PS_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(u + i), _mm256_loadu_ps(v + i), acc);
    sum = ps_hsum8(acc);
#endif
    for (; i < n; i++) sum += u[i] * v[i];
    return sum;
}

#if defined(PS_AVX2)
typedef __m256 pk_acc;
#else
typedef float pk_acc;
#endif

/* The integer dots of one storage block b (runs from `run` on) with R activation rows, scaled into acc_even /
 * acc_odd by run parity (two dependency chains), and its runs' offsets into m_lo / m_hi. */
PK_INLINE void pk_block(int fmt, const uint8_t *b, int64_t run, const pk_act *act, int R, pk_acc *acc_even,
                        pk_acc *acc_odd, float *m_lo, float *m_hi) {
    pk_scales s;
    const int runs = (int)(PK_BLOCK_VALUES[fmt] / 32);
    pk_block_scales(fmt, b, &s);
    for (int j = 0; j < runs; j++) {
        pk_acc *acc = j & 1 ? acc_odd : acc_even;
        const int64_t k = run + j;
        m_lo[j] = s.m[j][0];
        m_hi[j] = s.m[j][1];
#if defined(PS_AVX2)
        __m256i u = pk_codes_avx2(fmt, b, j);
        for (int r = 0; r < R; r++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(act[r].q + 32 * k));
            __m256 isum = _mm256_cvtepi32_ps(pk_dot(u, q, fmt == PK_Q8_0));
            const float a = act[r].a[k];
            __m256 scale = fmt == PK_Q6_K ? _mm256_set_m128(_mm_set1_ps(s.d[j][1] * a), _mm_set1_ps(s.d[j][0] * a))
                                          : _mm256_set1_ps(s.d[j][0] * a);
            acc[r] = _mm256_fmadd_ps(isum, scale, acc[r]);
        }
#else
        uint8_t u[32];
        pk_codes_scalar(fmt, b, j, u);
        for (int r = 0; r < R; r++) {
            const int8_t *q = act[r].q + 32 * k;
            int32_t lo = 0, hi = 0;
            for (int l = 0; l < 16; l++) { lo += u[l] * q[l]; hi += u[l + 16] * q[l + 16]; }
            acc[r] += act[r].a[k] * (s.d[j][0] * (float)lo + s.d[j][1] * (float)hi);
        }
#endif
    }
}

static inline float pk_acc_sum(pk_acc a, pk_acc b) {
#if defined(PS_AVX2)
    return ps_hsum8(_mm256_add_ps(a, b));
#else
    return a + b;
#endif
}

/* out[r] = dot(weight row w, activation row act[r]) for r < R (R <= PK_TILE); fmt and R are constants after
 * inlining, so every switch on them folds away. */
PK_INLINE void pk_row_dot(int fmt, const uint8_t *w, int64_t nblocks, const pk_act *act, int R, float *out) {
    const int64_t bb = PK_BLOCK_BYTES[fmt], runs = PK_BLOCK_VALUES[fmt] / 32;
    float m_lo[PK_SEG + 8], m_hi[PK_SEG + 8], macc[PK_TILE] = {0};
    pk_acc acc0[PK_TILE], acc1[PK_TILE];
    for (int r = 0; r < R; r++) {
#if defined(PS_AVX2)
        acc0[r] = acc1[r] = _mm256_setzero_ps();
#else
        acc0[r] = acc1[r] = 0.0f;
#endif
    }
    int64_t seg = 0, n = 0;  /* the segment's first run, its runs so far */
    for (int64_t blk = 0; blk < nblocks; blk++) {
        /* 32-value formats alternate chains by block, the K formats by run within their block */
        const int odd = runs == 1 && (blk & 1);
        pk_block(fmt, w + blk * bb, seg + n, act, R, odd ? acc1 : acc0, odd ? acc0 : acc1, m_lo + n, m_hi + n);
        n += runs;
        if (n >= PK_SEG || blk == nblocks - 1) {
            for (int r = 0; r < R; r++) {
                macc[r] += fmt == PK_Q6_K ? pk_fdot(m_lo, act[r].slo + seg, n) + pk_fdot(m_hi, act[r].shi + seg, n)
                                          : pk_fdot(m_lo, act[r].sall + seg, n);
            }
            seg += n;
            n = 0;
        }
    }
    for (int r = 0; r < R; r++) out[r] = pk_acc_sum(acc0[r], acc1[r]) + macc[r];
}

#define PK_TILES(F)                                                                         \
    switch (R) {                                                                            \
    case 1: pk_row_dot(F, w, nblocks, act, 1, out); return;                                 \
    case 2: pk_row_dot(F, w, nblocks, act, 2, out); return;                                 \
    case 3: pk_row_dot(F, w, nblocks, act, 3, out); return;                                 \
    default: pk_row_dot(F, w, nblocks, act, PK_TILE, out); return;                          \
    }

static void pk_row_dot_any(int fmt, const uint8_t *w, int64_t nblocks, const pk_act *act, int R, float *out) {
    switch (fmt) {
    case PK_Q4_0: PK_TILES(PK_Q4_0)
    case PK_Q4_1: PK_TILES(PK_Q4_1)
    case PK_Q5_0: PK_TILES(PK_Q5_0)
    case PK_Q8_0: PK_TILES(PK_Q8_0)
    case PK_Q4_K: PK_TILES(PK_Q4_K)
    case PK_Q5_K: PK_TILES(PK_Q5_K)
    default: PK_TILES(PK_Q6_K)
    }
}

/* One activation row -> int8 codes per run of 32, the run's scale and a * sum of each half's codes. */
static void pk_quantize_row(const float *x, int64_t n, int8_t *q, float *a, float *slo, float *shi, float *sall) {
    for (int64_t run = 0; run < n / 32; run++) {
        const float *v = x + 32 * run;
        float amax = 0.0f;
        for (int l = 0; l < 32; l++) amax = fabsf(v[l]) > amax ? fabsf(v[l]) : amax;  /* fmaxf's result, no libm call */
        float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sums[2] = {0, 0};
        for (int l = 0; l < 32; l++) {
            int8_t c = (int8_t)nearbyintf(v[l] * inv);
            q[32 * run + l] = c;
            sums[l >> 4] += c;
        }
        a[run] = scale;
        slo[run] = scale * (float)sums[0];
        shi[run] = scale * (float)sums[1];
        sall[run] = scale * (float)(sums[0] + sums[1]);
    }
}


/* Output rows in chunks over the threads; each weight row is unpacked once per tile of PK_TILE activation rows. */
static void pk_product(const ps_packed_state *st, const float *x, int64_t rows, float *y, const int8_t *q,
                       const float *a, const float *slo, const float *shi, const float *sall) {
    const int64_t in = st->in_features, out = st->out_features, nruns = in / 32;
    const int64_t nblocks = in / PK_BLOCK_VALUES[st->format], chunks = (out + PK_CHUNK - 1) / PK_CHUNK;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t o_end = (c + 1) * PK_CHUNK < out ? (c + 1) * PK_CHUNK : out;
        const int tile = q != NULL ? PK_TILE : PK_F32_TILE;
        for (int64_t r0 = 0; r0 < rows; r0 += tile) {
            const int R = rows - r0 < tile ? (int)(rows - r0) : tile;
            pk_act act[PK_TILE];
            for (int r = 0; q != NULL && r < R; r++) {
                const int64_t o = (r0 + r) * nruns;
                act[r] = (pk_act){q + (r0 + r) * in, a + o, slo + o, shi + o, sall + o};
            }
            for (int64_t o = c * PK_CHUNK; o < o_end; o++) {
                float dots[PK_F32_TILE];
                const uint8_t *w = st->data + o * st->row_bytes;
                if (q != NULL) pk_row_dot_any(st->format, w, nblocks, act, R, dots);
                else pk_f32_row_dot_any(st->format, w, nblocks, x + r0 * in, in, R, dots);
                const float bias = st->bias ? st->bias[o] : 0.0f;
                for (int r = 0; r < R; r++) y[(r0 + r) * out + o] = dots[r] + bias;
            }
        }
    }
}

PK_EXPORT int pagedserve_packed_linear_threads(const ps_packed_state *st, const float *x, int64_t rows, float *y,
                                               int threads) {
    if (pk_check(st) || rows < 0) return 1;
    if (st->row_group) return pk_grouped_linear(st, x, rows, y, threads);  /* packed_grouped.c */
    const int64_t in = st->in_features, nruns = in / 32;
    if (rows > st->int8_max_rows) {
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
        pk_product(st, x, rows, y, NULL, NULL, NULL, NULL, NULL);
        return 0;
    }
    int8_t *q = malloc((size_t)(rows * in) + 1);
    float *a = malloc(sizeof(float) * (size_t)(rows * nruns * 4) + 1);
    if (q == NULL || a == NULL) {
        free(q);
        free(a);
        return 2;
    }
    float *slo = a + rows * nruns, *shi = slo + rows * nruns, *sall = shi + rows * nruns;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t o = r * nruns;
            pk_quantize_row(x + r * in, in, q + r * in, a + o, slo + o, shi + o, sall + o);
        }
        pk_product(st, x, rows, y, q, a, slo, shi, sall);
    }
    free(q);
    free(a);
    return 0;
}

/* The ps_linear_fn of kernels/cpu/linear.h. */
PK_EXPORT int pagedserve_packed_linear(const void *state, const float *x, int64_t rows, float *y) {
    const ps_packed_state *st = state;
    if (st == NULL) return 1;
    return pagedserve_packed_linear_threads(st, x, rows, y, st->num_threads > 0 ? st->num_threads : omp_get_max_threads());
}

PK_EXPORT const char *pagedserve_packed_isa(void) { return PK_ISA; }

PS_SIZEOF(packed_state, ps_packed_state)
