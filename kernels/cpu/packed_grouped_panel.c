/* Many activation rows (prefill, large batches) through the interleaved-rows layout of every GGUF format
 * (packed_grouped.c: Q4_0, Q4_1, Q8_0; packed_grouped_wide.c: Q5_0 and the K formats) in the 8-lane int16 builds
 * (avx2, avx2_vnni: act_q16.h's PQ_LANES8).
 *
 * Why: those kernels take 4 activation rows per pass over a group's weights and widen the codes again on every
 * pass, so their cost per row stays flat (~75-85 GFLOP/s per core for Q4_K and Q4_0, ~50 for Q6_K on a Sapphire
 * Rapids core capped at AVX2) below the fp32 FMA GEMM of the dense copy (~95): prefill needed that copy, 4 bytes a
 * weight. Here each run's codes (16 rows x 32 inputs) are widened once into int16 vectors in L1, then every row
 * of a chunk of activations takes only the pair dots (vpmaddwd + vpaddd, 16 products per 2 instructions, or one
 * vpdpwssd), 4 rows at a time with their 8 accumulators in registers.
 *
 * Numerics: the same as packed_grouped.c's and packed_grouped_wide.c's, bit for bit (tests/test_packed_kernels.py):
 * the same int16 activations (pq_quantize_block), exact int32 dots (Q6_K's codes centred before the dot instead
 * of after: the same integer), and per run the same float epilogue in the same order, so a row's result does not
 * depend on which kernel served it or on the rows beside it.
 *
 * Loop order: rows in chunks whose int16 activations stay in L2 (outer), groups work-shared over the threads, runs,
 * then the chunk's rows; activations are stored run-major per chunk so that a group's sweep reads them in order. */
#include "isa.h"
#include <omp.h>

#include "act_q16_dots.h"
#include "packed_wide_layout.h"

#if defined(PQ_LANES8) || defined(PS_AVX512_VNNI)
#define PKP_CHUNK 128          /* most activation rows per chunk */
#define PKP_CHUNK_BYTES 1048576 /* the int16 activations one chunk may hold */

#if defined(PS_AVX512_VNNI)
#include "packed_grouped_panel16.h"
#else
#define PKP_TILE 4             /* activation rows per micro-kernel call (6 spilled 2 of 12 accumulators: slower) */
#define PKP_VECS 32            /* code registers per run: a pair of inputs in two 8-row halves */
#define PKP_ALIGN 32
typedef __m256i pkp_vec;

/* Q8_0's 32 inputs x 16 bytes (byte r of input k's 16 = row r's int8 code) as u[2i + s]: pair i = inputs 2i,
 * 2i + 1 (the activations' natural order), rows 8s..8s+7 (act_q16.h's 8-lane pq_dots8 widens them alike). */
PKW_INLINE void pkp_codes8(const uint8_t *codes, __m256i *u) {
    for (int i = 0; i < 16; i++) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(codes + 32 * i));
        const __m128i b = _mm_loadu_si128((const __m128i *)(codes + 32 * i + 16));
        _mm256_store_si256(u + 2 * i, _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b)));
        _mm256_store_si256(u + 2 * i + 1, _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b)));
    }
}

/* Run `run`'s codes of the 16 rows as u[2i + s]: pair i = 4c + p (inputs 8c + p, 8c + p + 4 as two int16, the
 * order of the activations), tile rows 8s..8s+7; Q6_K's centred (u - 32). */
PKW_INLINE void pkp_codes(int fmt, const uint8_t *run, __m256i *u) {
    if (fmt == PK_Q8_0) {
        pkp_codes8(run, u);
        return;
    }
    if (fmt == PK_Q6_K) {
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 2; s++) {
                __m256i v[8];
                pkw_q6_codes(run + 192 * h + 32 * s, v);
                for (int m = 0; m < 8; m++)
                    _mm256_store_si256(u + 2 * (8 * h + m) + s, _mm256_sub_epi16(v[m], _mm256_set1_epi16(32)));
            }
        return;
    }
    const __m256i low4 = _mm256_set1_epi32(0x000F000F);
    __m256i hw[2];
    for (int s = 0; s < (fmt == PK_Q5_0 || fmt == PK_Q5_K ? 2 : 0); s++)
        hw[s] = _mm256_loadu_si256((const __m256i *)(run + 256 + 32 * s));
    for (int c = 0; c < 4; c++)
        for (int s = 0; s < 2; s++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(run + 64 * c + 32 * s));
            for (int p = 0; p < 4; p++) {
                __m256i v = p == 3 ? _mm256_srli_epi16(w, 12) : _mm256_and_si256(pq_shift32(w, 4 * p), low4);
                if (fmt == PK_Q5_0 || fmt == PK_Q5_K)
                    v = _mm256_or_si256(v, _mm256_and_si256(pq_shift32(hw[s], 4 * c + p - 4),
                                                            _mm256_set1_epi32(0x00100010)));
                _mm256_store_si256(u + 2 * (4 * c + p) + s, v);
            }
        }
}

/* tot[16 r ..] += per lane (d da) dot (+ m sx): packed_grouped_wide.c's epilogue, one input half (Q6_K) or the run,
 * for R rows whose pairs i0..i1 of q (32 int16 per row, rows consecutive) meet the codes u. */
PKW_INLINE void pkp_rows(const __m256i *u, int i0, int i1, const int16_t *q, const float *da, const float *sx,
                         const __m256 *d, const __m256 *m, int R, float *tot) {
    __m256i acc[2 * PKP_TILE];
    /* unrolled whole, so that the sums are registers, not an array on the stack (gcc left the loop rolled once
     * the kernel served 7 formats, and ran ~1.7x slower) */
#pragma GCC unroll 8
    for (int i = 0; i < 2 * R; i++) acc[i] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int i = i0; i < i1; i++) {
        const __m256i u0 = _mm256_load_si256(u + 2 * i), u1 = _mm256_load_si256(u + 2 * i + 1);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m256i pair = _mm256_set1_epi32(pq_pair(q + 32 * r + 2 * i));
            acc[2 * r] = pq_dpwssd(acc[2 * r], u0, pair);
            acc[2 * r + 1] = pq_dpwssd(acc[2 * r + 1], u1, pair);
        }
        /* keeps each sum a register chain: left free, gcc reassociated the unrolled integer sums into trees of
         * products spilled to the stack (~1.6x slower) */
#pragma GCC unroll 8
        for (int a = 0; a < 2 * R; a++) __asm__("" : "+x"(acc[a]));
    }
    for (int r = 0; r < R; r++) {
        const __m256 dar = _mm256_set1_ps(da[r]);
        for (int s = 0; s < 2; s++) {
            __m256 t = _mm256_load_ps(tot + 16 * r + 8 * s);
            t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[2 * r + s]), _mm256_mul_ps(d[s], dar), t);
            if (m) t = _mm256_fmadd_ps(m[s], _mm256_set1_ps(sx[r]), t);
            _mm256_store_ps(tot + 16 * r + 8 * s, t);
        }
    }
}

/* Run j of `tile` for R rows: the whole run, or Q6_K's two halves with a scale each. */
PKW_INLINE void pkp_run(int fmt, const __m256i *u, const uint8_t *tile, int j, const int16_t *q, const float *da,
                        const float *sx, int R, float *tot) {
    __m256 d[4], m[2];
    if (pkp_wide(fmt)) {
        pkw_scales(fmt, tile, j, d, m);
    } else {  /* packed_grouped.c's: d, and m = Q4_1's own or -8 d (Q8_0: none) */
        for (int s = 0; s < 2; s++) {
            d[s] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 16 * s)));
            m[s] = fmt == PK_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 32 + 16 * s)))
                                  : _mm256_mul_ps(d[s], _mm256_set1_ps(-8.0f));
        }
    }
    if (fmt == PK_Q8_0) {
        pkp_rows(u, 0, 16, q, da, sx, d, NULL, R, tot);
    } else if (fmt == PK_Q6_K) {
        const __m256 d0[2] = {d[0], d[1]}, d1[2] = {d[2], d[3]};
        pkp_rows(u, 0, 8, q, da, sx, d0, NULL, R, tot);
        pkp_rows(u, 8, 16, q, da, sx, d1, NULL, R, tot);
    } else {
        pkp_rows(u, 0, 16, q, da, sx, d, m, R, tot);
    }
}

/* R a constant in each instance, PKP_TILE's named too (left to the fall-through alone, gcc merged the instances
 * into one with R a variable and its sums on the stack, ~1.5x slower); R never exceeds PKP_TILE */
#define PKP_CASE(F, N) \
    if (R == N) { pkp_run(F, u, tile, j, q, da, sx, N < PKP_TILE ? N : PKP_TILE, tot); return; }
#define PKP_CASES(F) { PKP_CASE(F, 1) PKP_CASE(F, 2) PKP_CASE(F, 3) PKP_CASE(F, 4) \
                       pkp_run(F, u, tile, j, q, da, sx, PKP_TILE, tot); return; }

static inline int pkp_tile_rows(int64_t n) { return n < PKP_TILE ? (int)n : PKP_TILE; }
#endif

static void pkp_any(int fmt, const pkp_vec *u, const uint8_t *tile, int j, const int16_t *q, const float *da,
                    const float *sx, int R, float *tot) {
    switch (fmt) {
#if defined(PQ_LANES8)  /* the 16-lane build serves these tiles with packed_grouped.c's own kernel at any row count */
    case PK_Q4_0: PKP_CASES(PK_Q4_0)
    case PK_Q4_1: PKP_CASES(PK_Q4_1)
    case PK_Q8_0: PKP_CASES(PK_Q8_0)
#endif
    case PK_Q5_0: PKP_CASES(PK_Q5_0)
    case PK_Q4_K: PKP_CASES(PK_Q4_K)
    case PK_Q5_K: PKP_CASES(PK_Q5_K)
    default: PKP_CASES(PK_Q6_K)
    }
}

static void pkp_codes_any(int fmt, const uint8_t *run, pkp_vec *u) {
    switch (fmt) {
    case PK_Q4_0: case PK_Q4_1: case PK_Q4_K: pkp_codes(PK_Q4_K, run, u); return;  /* the same 4-bit plane */
    case PK_Q8_0: pkp_codes(PK_Q8_0, run, u); return;
    case PK_Q5_0: pkp_codes(PK_Q5_0, run, u); return;
    case PK_Q5_K: pkp_codes(PK_Q5_K, run, u); return;
    default: pkp_codes(PK_Q6_K, run, u); return;
    }
}

/* One group's 16 outputs for the mb rows of a chunk whose activations (run-major: [run][row][32]) start at q. */
static void pkp_group(int fmt, const uint8_t *tiles, int64_t nb, const int16_t *q, const float *da, const float *sx,
                      int64_t mb, const float *bias, float *y, int64_t out) {
    pkp_vec u[PKP_VECS] __attribute__((aligned(PKP_ALIGN)));
    float tot[16 * PKP_CHUNK] __attribute__((aligned(PKP_ALIGN)));
    for (int64_t r = 0; r < mb; r++)
        for (int l = 0; l < 16; l++) tot[16 * r + l] = bias ? bias[l] : 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tile = tiles + b * pkw_tile_bytes(fmt);
        for (int j = 0; j < pkp_runs(fmt); j++) {
            const int64_t k = b * pkp_runs(fmt) + j;
            pkp_codes_any(fmt, tile + pkp_run_at(fmt, j), u);
            for (int64_t r0 = 0, R; r0 < mb; r0 += R) {
                R = pkp_tile_rows(mb - r0);
                pkp_any(fmt, u, tile, j, q + 32 * (k * mb + r0), da + k * mb + r0, sx + k * mb + r0, (int)R,
                        tot + 16 * r0);
            }
        }
    }
    for (int64_t r = 0; r < mb; r++) memcpy(y + r * out, tot + 16 * r, 16 * sizeof(float));
}

/* pk_grouped_linear for many rows (packed_grouped.c calls it from PKP_MIN_ROWS rows on). Returns 0, or 2 when
 * out of memory. */
int pkp_panel_linear(const ps_packed_state *st, const float *x, int64_t rows, float *y, int threads) {
    const int fmt = st->format;
    const int64_t in = st->in_features, out = st->out_features, nruns = in / 32, groups = out / PK_GROUP_ROWS;
    const int64_t nb = in / PK_BLOCK_VALUES[fmt], group_bytes = nb * pkw_tile_bytes(fmt);
    int64_t chunk = PKP_CHUNK_BYTES / (2 * in);
    chunk = chunk > PKP_CHUNK ? PKP_CHUNK : chunk < PKP_TILE ? PKP_TILE : chunk;
    pq_act act;
    if (pq_alloc(&act, rows, nruns)) return 2;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        /* row r's run k at [chunk start * nruns + k * mb + r - chunk start]: each chunk run-major */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t m0 = r / chunk * chunk, mb = rows - m0 < chunk ? rows - m0 : chunk;
            for (int64_t k = 0; k < nruns; k++) {
                const int64_t at = m0 * nruns + k * mb + r - m0;
                pq_quantize_block(x + r * in + 32 * k, fmt != PK_Q8_0, act.q + 32 * at, act.da + at, act.sx + at);
            }
        }
        for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
            const int64_t mb = rows - m0 < chunk ? rows - m0 : chunk;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; g++)
                pkp_group(fmt, st->data + g * group_bytes, nb, act.q + 32 * m0 * nruns, act.da + m0 * nruns,
                          act.sx + m0 * nruns, mb, st->bias ? st->bias + g * PK_GROUP_ROWS : NULL,
                          y + m0 * out + g * PK_GROUP_ROWS, out);
        }
    }
    pq_free(&act);
    return 0;
}
#endif
