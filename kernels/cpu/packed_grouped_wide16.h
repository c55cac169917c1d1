/* The 16-lane AVX512-VNNI form of packed_grouped_wide.c's interleaved-rows kernel (Q5_0, Q4_K, Q5_K, Q6_K), included
 * there under PS_AVX512_VNNI, after the layout's helpers (pkw_header, pkw_run_bytes, pkw_tile_bytes, pkw_runs,
 * pkw_scales, PKW_TILE, PKW_PREFETCH, PKW_INLINE) it reads.
 *
 * Why: the 8-lane kernel of the other int16 builds took a group's 16 rows in two halves, so on AVX-512 hosts these
 * formats ran at ~13-20 GB/s per core against ~26 for Q4_0's 16 lanes, bound by instructions. Here one register
 * holds the 16 rows: the same exact integer dots and, lane by lane, the same float epilogue, so the results equal
 * the 8-lane builds' bit for bit (tests/test_packed_kernels.py) with about half the instructions. */
#ifndef PAGEDSERVE_CPU_PACKED_GROUPED_WIDE16_H
#define PAGEDSERVE_CPU_PACKED_GROUPED_WIDE16_H

/* Q4_K for up to 2 activation rows, nibbles masked in place (the 8-lane pkw_dots_q4k's reasoning): acc[2r] the
 * dot, acc[2r + 1] zero. */
PKW_INLINE void pkw_dots_q4k(const uint8_t *run, const int16_t *q, int64_t qstride, int R, __m512i *acc) {
    __m512i part[6];  /* [3r + scale class] */
    for (int i = 0; i < 3 * R; i++) part[i] = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i w = _mm512_loadu_si512(run + 64 * c);
        for (int p = 0; p < 4; p++) {
            const __m512i u = p == 3 ? _mm512_srli_epi16(w, 12) : _mm512_and_si512(w, _mm512_set1_epi32(0x000F000F << 4 * p));
            for (int r = 0; r < R; r++) {
                const int at = 3 * r + (p == 3 ? 0 : p);
                part[at] = _mm512_dpwssd_epi32(part[at], u, _mm512_set1_epi32(pq_pair(q + r * qstride + 8 * c + 2 * p)));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const __m512i *pt = part + 3 * r;
        acc[2 * r] = _mm512_add_epi32(pt[0], _mm512_add_epi32(_mm512_srai_epi32(pt[1], 4), _mm512_srai_epi32(pt[2], 8)));
        acc[2 * r + 1] = _mm512_setzero_si512();
    }
}

/* Q6_K: acc[2r + h] = dot(u - 32, q) of input half h, started at its centring (the 8-lane pkw_dots_q6k's). */
PKW_INLINE void pkw_dots_q6k(const uint8_t *run, const int16_t *q, int64_t qstride, const int32_t *sq,
                             int64_t sstride, int R, __m512i *acc) {
    for (int h = 0; h < 2; h++) {
        __m512i u[8];
        pkw_q6_codes(run + 192 * h, u);
        for (int r = 0; r < R; r++) {
            __m512i a = _mm512_set1_epi32(sq[r * sstride + h]), b = _mm512_setzero_si512();
            for (int m = 0; m < 8; m++) {
                const __m512i pair = _mm512_set1_epi32(pq_pair(q + r * qstride + 16 * h + 2 * m));
                if (R <= 2 && (m & 1)) b = _mm512_dpwssd_epi32(b, u[m], pair);
                else a = _mm512_dpwssd_epi32(a, u[m], pair);
            }
            acc[2 * r + h] = R <= 2 ? _mm512_add_epi32(a, b) : a;
        }
    }
}

/* One run's integer dots (Q5_0, Q4_K, Q5_K): acc[2r + h] for activation row r (up to 2 rows two chains h by p's
 * parity, summed by the caller). Codes as two int16 per lane in act_q16.h's 4-bit order. */
PKW_INLINE void pkw_dots(int fmt, const uint8_t *run, const int16_t *q, int64_t qstride, int R, __m512i *acc) {
    if (fmt == PK_Q4_K && R <= 2) {
        pkw_dots_q4k(run, q, qstride, R, acc);
        return;
    }
    const __m512i low4 = _mm512_set1_epi32(0x000F000F);
    for (int i = 0; i < 2 * R; i++) acc[i] = _mm512_setzero_si512();
    const __m512i hw = fmt == PK_Q4_K ? _mm512_setzero_si512() : _mm512_loadu_si512(run + 256);
    for (int c = 0; c < 4; c++) {
        const __m512i w = _mm512_loadu_si512(run + 64 * c);
        for (int p = 0; p < 4; p++) {
            /* p = 3: the top nibble of each int16 needs no mask */
            __m512i u = p == 3 ? _mm512_srli_epi16(w, 12) : _mm512_and_si512(pq_shift32(w, 4 * p), low4);
            if (fmt != PK_Q4_K)  /* u | (high & mask) */
                u = _mm512_ternarylogic_epi32(u, pq_shift32(hw, 4 * c + p - 4), _mm512_set1_epi32(0x00100010), 0xF8);
            const int h = R <= 2 && (p & 1);
            for (int r = 0; r < R; r++) {
                const __m512i pair = _mm512_set1_epi32(pq_pair(q + r * qstride + 8 * c + 2 * p));
                acc[2 * r + h] = _mm512_dpwssd_epi32(acc[2 * r + h], u, pair);
            }
        }
    }
}

/* y[r][16 rows of group] for R activation rows; R and fmt are constants after inlining. */
PKW_INLINE void pkw_rows(int fmt, const uint8_t *tiles, int64_t nb, const float *x, int64_t in, pq_act act,
                         const int32_t *sq, int R, const float *bias, float *y, int64_t out) {
    (void)x, (void)in;
    const int64_t tb = pkw_tile_bytes(fmt), nruns = nb * pkw_runs(fmt);
    __m512 tot[PKW_TILE];
    for (int r = 0; r < R; r++) tot[r] = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const int kfmt = fmt == PK_Q4_K || fmt == PK_Q5_K;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tile = tiles + b * tb;
        uint8_t sc[128], mn[128];  /* K formats: pkw_k_bytes, and d, -dmin (the 8-lane kernel's reason) */
        const __m512 dr = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tile));
        const __m512 nd = _mm512_xor_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 32))),
                                        _mm512_set1_ps(-0.0f));
        if (kfmt) pkw_k_bytes(tile, sc, mn);
        for (int j = 0; j < pkw_runs(fmt); j++) {
            const uint8_t *run = tile + pkw_header(fmt) + j * pkw_run_bytes(fmt);
            for (int64_t l = 0; l < pkw_run_bytes(fmt); l += 64)
                _mm_prefetch((const char *)run + PKW_PREFETCH + l, _MM_HINT_T0);
            const int64_t k = b * pkw_runs(fmt) + j;
            __m512i acc[2 * PKW_TILE];
            __m512 d[2], m[1];
            if (fmt == PK_Q6_K) pkw_dots_q6k(run, act.q + 32 * k, 32 * nruns, sq + 2 * k, 2 * nruns, R, acc);
            else pkw_dots(fmt, run, act.q + 32 * k, 32 * nruns, R, acc);
            if (kfmt) {
                const __m128i scj = _mm_loadu_si128((const __m128i *)(sc + 16 * j));
                const __m128i mnj = _mm_loadu_si128((const __m128i *)(mn + 16 * j));
                d[0] = _mm512_mul_ps(dr, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scj)));
                m[0] = _mm512_mul_ps(nd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mnj)));
            } else {
                pkw_scales(fmt, tile, j, d, m);
            }
            for (int r = 0; r < R; r++) {
                const __m512 da = _mm512_set1_ps(act.da[r * nruns + k]);
                __m512 t = tot[r];
                if (fmt == PK_Q6_K) {
                    for (int h = 0; h < 2; h++)
                        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[2 * r + h]), _mm512_mul_ps(d[h], da), t);
                } else {
                    const __m512i dot = _mm512_add_epi32(acc[2 * r], acc[2 * r + 1]);
                    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d[0], da), t);
                    t = _mm512_fmadd_ps(m[0], _mm512_set1_ps(act.sx[r * nruns + k]), t);
                }
                tot[r] = t;
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * out, tot[r]);
}

#endif
