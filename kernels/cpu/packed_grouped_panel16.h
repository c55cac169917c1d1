/* The 16-lane AVX512-VNNI form of packed_grouped_panel.c's many-row kernel, included there under PS_AVX512_VNNI
 * after the layout helpers (packed_wide_layout.h) and before the generic driver it serves; packed_grouped_bf16.c
 * reads its code widening (pkp_codes).
 *
 * Why: on the AVX-512 tiers the wide formats' few-row kernel (packed_grouped_wide16.h) widens a group's codes again
 * for every 4 activation rows (Q6_K, in the layout it had then: 2 shifts, 2 ternary-logic ops and a subtraction
 * per pair), so a prefill chunk
 * paid that ~16-64 times per weight and those layers kept a dense copy for it. Here one register holds a 32-input
 * run's pair of codes for all 16 rows (16 registers for the run, widened once into L1), and every activation row
 * then takes one vpdpwssd per pair with the activations broadcast from memory: ~2x the few-row kernel for Q6_K,
 * level for Q4_K. (The 4/8-bit tiles' kernel in packed_grouped.c takes 8 rows per pass with one and per code
 * pair, and stayed ~1.2-1.35x ahead of this at every row count measured: it serves them.)
 *
 * Numerics: the codes (Q6_K's centred before the dot: the same integer as the few-row kernel's centring), the
 * int16 activations, the exact int32 sums and, lane by lane, the float epilogue of the few-row avx512_vnni kernels,
 * in the same order per run: a row's result is theirs bit for bit (tests/test_packed_kernels.py). */
#ifndef PAGEDSERVE_CPU_PACKED_GROUPED_PANEL16_H
#define PAGEDSERVE_CPU_PACKED_GROUPED_PANEL16_H

#define PKP_TILE 8      /* activation rows per micro-kernel call: 8 integer chains hide vpdpwssd's latency */
#define PKP_VECS 16     /* code registers per run: one per pair of inputs */
#define PKP_ALIGN 64
typedef __m512i pkp_vec;

/* Q8_0's 32 inputs x 16 bytes (byte r of input k's 16 = row r's int8 code) as u[i]: lane r = row r's codes of
 * inputs 2i, 2i + 1 (the activations' natural order), as two int16. */
PKW_INLINE void pkp_codes8(const uint8_t *codes, __m512i *u) {
    for (int i = 0; i < 16; i++) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(codes + 32 * i));
        const __m128i b = _mm_loadu_si128((const __m128i *)(codes + 32 * i + 16));
        const __m256i pairs = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
        _mm512_store_si512(u + i, _mm512_cvtepi8_epi16(pairs));
    }
}

/* Run `run`'s codes of the 16 rows as u[4c + p]: lane r = row r's inputs 8c + p and 8c + p + 4 as two int16 (the
 * order of the activations); Q6_K's centred (u - 32). */
PKW_INLINE void pkp_codes(int fmt, const uint8_t *run, __m512i *u) {
    if (fmt == PK_Q8_0) {
        pkp_codes8(run, u);
        return;
    }
    if (fmt == PK_Q6_K) {
        for (int h = 0; h < 2; h++) {
            __m512i v[8];
            pkw_q6_codes(run + 192 * h, v);
            for (int m = 0; m < 8; m++)
                _mm512_store_si512(u + 8 * h + m, _mm512_sub_epi16(v[m], _mm512_set1_epi16(32)));
        }
        return;
    }
    const __m512i low4 = _mm512_set1_epi32(0x000F000F);
    const __m512i hw = fmt == PK_Q5_0 || fmt == PK_Q5_K ? _mm512_loadu_si512(run + 256) : _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i w = _mm512_loadu_si512(run + 64 * c);
        for (int p = 0; p < 4; p++) {
            __m512i v = p == 3 ? _mm512_srli_epi16(w, 12) : _mm512_and_si512(pq_shift32(w, 4 * p), low4);
            if (fmt == PK_Q5_0 || fmt == PK_Q5_K)  /* v | (high & mask) */
                v = _mm512_ternarylogic_epi32(v, pq_shift32(hw, 4 * c + p - 4), _mm512_set1_epi32(0x00100010), 0xF8);
            _mm512_store_si512(u + 4 * c + p, v);
        }
    }
}

/* tot[16 r ..] += (d da) dot (+ m sx) for R rows whose pairs i0..i1 of q (32 int16 per row, rows consecutive)
 * meet the codes u: one input half (Q6_K) or the run. */
PKW_INLINE void pkp_rows(const __m512i *u, int i0, int i1, const int16_t *q, const float *da, const float *sx,
                         __m512 d, const __m512 *m, int R, float *tot) {
    __m512i acc[PKP_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int i = i0; i < i1; i++) {
        const __m512i ui = _mm512_load_si512(u + i);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpwssd_epi32(acc[r], ui, _mm512_set1_epi32(pq_pair(q + 32 * r + 2 * i)));
        /* each sum a register chain (packed_grouped_panel.c's 8-lane reason) */
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) __asm__("" : "+v"(acc[r]));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        __m512 t = _mm512_load_ps(tot + 16 * r);
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(d, _mm512_set1_ps(da[r])), t);
        if (m) t = _mm512_fmadd_ps(*m, _mm512_set1_ps(sx[r]), t);
        _mm512_store_ps(tot + 16 * r, t);
    }
}

/* Run j of `tile` for R rows: the whole run, or Q6_K's two halves with a scale each. Q5_0 and the K formats only:
 * packed_grouped.c's own 16-lane kernel serves the 4/8-bit tiles at every row count. */
PKW_INLINE void pkp_run(int fmt, const __m512i *u, const uint8_t *tile, int j, const int16_t *q, const float *da,
                        const float *sx, int R, float *tot) {
    __m512 d[2], m[1];
    pkw_scales(fmt, tile, j, d, m);
    if (fmt == PK_Q6_K) {
        pkp_rows(u, 0, 8, q, da, sx, d[0], NULL, R, tot);
        pkp_rows(u, 8, 16, q, da, sx, d[1], NULL, R, tot);
    } else {
        pkp_rows(u, 0, 16, q, da, sx, d[0], m, R, tot);
    }
}

/* R a constant in each instance: 8, 4, 2 or 1 (pkp_tile_rows) */
#define PKP_CASE(F, N) \
    if (R == N) { pkp_run(F, u, tile, j, q, da, sx, N, tot); return; }
#define PKP_CASES(F) { PKP_CASE(F, 1) PKP_CASE(F, 2) PKP_CASE(F, 4) \
                       pkp_run(F, u, tile, j, q, da, sx, PKP_TILE, tot); return; }

/* The rows of the next micro-kernel call when n remain. */
static inline int pkp_tile_rows(int64_t n) { return n >= 8 ? 8 : n >= 4 ? 4 : n >= 2 ? 2 : 1; }

#endif
