/* A grouped GGUF matrix (packed_grouped.c, packed_grouped_wide.c) dequantized, groups g0..g1, into the dense bf16
 * grouped layout (dense_grouped.c: per input pair one 64-byte tile whose word l holds row l's inputs 2p in the low
 * half and 2p + 1 in the high half) that kernels/cpu/dense_gemm.c multiplies with AMX tiles or vdpbf16ps.
 *
 * Why: quant/gguf_prefill.py serves long prefill chunks so, a slab of rows at a time, instead of holding the
 * matrix expanded; the row-at-a-time dequantizer (packed_dequantize.c) gathers each row's codes from the
 * interleaved tiles one byte at a time and needed a regrouping pass after it (~0.4-2 G weights/s per core).
 * Here a run's codes of all 16 rows are widened in registers (packed_grouped_panel16.h's pkp_codes) and each
 * input pair is one 64-byte store.
 *
 * Values: w = fma(u, d, m) per row (Q6_K: (u - 32) d, Q8_0: u d), rounded to bf16 to nearest even: the same bits as
 * packed_dequantize.c's bf16 rows (tests/test_packed_kernels.py). */
#include "isa.h"
#include <omp.h>

#include "act_q16_dots.h"
#include "packed_wide_layout.h"

#define PK_EXPORT __attribute__((visibility("default")))

#if defined(PS_AVX512_BF16)
#include "packed_grouped_panel16.h"

/* Run j of `tile` as the dense layout's 16 pair tiles at out, or (stride > 0) as 16 row-major rows of 32 values,
 * row l at out + l * stride words: each row's 16 pairs gathered from the tiles (still in L1). */
PKW_INLINE void pkb_run(int fmt, const uint8_t *tile, int j, uint32_t *out, int64_t stride) {
    uint32_t pairs[256] __attribute__((aligned(64)));
    uint32_t *to = stride ? pairs : out;
    __m512i u[16] __attribute__((aligned(64)));
    __m512 v[32], d[2], m[1];
    pkp_codes(fmt, tile + pkp_run_at(fmt, j), u);
    if (pkp_wide(fmt)) {
        pkw_scales(fmt, tile, j, d, m);
    } else {
        d[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tile));
        m[0] = fmt == PK_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 32)))
                              : _mm512_mul_ps(d[0], _mm512_set1_ps(-8.0f));
    }
    if (fmt != PK_Q6_K) d[1] = d[0];
    if (fmt == PK_Q6_K || fmt == PK_Q8_0) m[0] = _mm512_setzero_ps();  /* signed codes */
    for (int i = 0; i < 16; i++) {
        /* pair i's inputs: 2i, 2i + 1 (Q8_0's natural order) or 8c + p, 8c + p + 4 (the 4-bit order, i = 4c + p) */
        const int a = fmt == PK_Q8_0 ? 2 * i : 8 * (i / 4) + i % 4, b = fmt == PK_Q8_0 ? a + 1 : a + 4;
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(u[i], 16), 16));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srai_epi32(u[i], 16));
        v[a] = _mm512_fmadd_ps(lo, d[a / 16], m[0]);
        v[b] = _mm512_fmadd_ps(hi, d[b / 16], m[0]);
    }
    for (int p = 0; p < 16; p++) {
        const __m512i even = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v[2 * p]));
        const __m512i odd = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v[2 * p + 1]));
        _mm512_storeu_si512(to + 16 * p, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
    }
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    for (int l = 0; stride && l < 16; l++)
        _mm512_storeu_si512(out + l * stride, _mm512_i32gather_epi32(column, (const void *)(pairs + l), 4));
}

/* fmt a constant in each instance */
static void pkb_group(int fmt, const uint8_t *tiles, int64_t nb, uint32_t *out, int64_t stride) {
#define PKB_CASE(F) \
    case F: for (int64_t k = 0; k < nb * pkp_runs(F); k++) \
        pkb_run(F, tiles + k / pkp_runs(F) * pkw_tile_bytes(F), (int)(k % pkp_runs(F)), out + (stride ? 16 : 256) * k, \
                stride); return;
    switch (fmt) {
    PKB_CASE(PK_Q4_0) PKB_CASE(PK_Q4_1) PKB_CASE(PK_Q8_0) PKB_CASE(PK_Q5_0) PKB_CASE(PK_Q4_K) PKB_CASE(PK_Q5_K)
    PKB_CASE(PK_Q6_K)
    default: return;  /* pk_check admitted only the formats above */
    }
#undef PKB_CASE
}
#endif

/* Groups [g0, g1) of a grouped matrix (row_group set) into dst: (g1 - g0) * 16 * in_features bf16 values in the
 * dense grouped layout, or row-major (row_major 1: what torch's GEMMs read). Returns 0; 2 where the build has no
 * AVX512-BF16 form (whatever the arguments); 1 for a bad request. */
PK_EXPORT int pagedserve_packed_grouped_bf16(const ps_packed_state *st, int64_t g0, int64_t g1, uint32_t *dst,
                                             int row_major, int threads) {
#if defined(PS_AVX512_BF16)
    if (pk_check(st) || !st->row_group || dst == NULL || g0 < 0 || g1 < g0 ||
        g1 * PK_GROUP_ROWS > st->out_features)
        return 1;
    const int fmt = st->format;
    const int64_t in = st->in_features, nb = in / PK_BLOCK_VALUES[fmt], group_bytes = nb * pkw_tile_bytes(fmt);
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t g = g0; g < g1; g++)
        pkb_group(fmt, st->data + g * group_bytes, nb, dst + (g - g0) * 8 * in, row_major ? in / 2 : 0);
    return 0;
#else
    (void)st, (void)g0, (void)g1, (void)dst, (void)row_major, (void)threads;
    return 2;
#endif
}
