/* The 8-lane form (avx2, avx2_vnni, avx512) of packed_grouped_wide.c's interleaved-rows kernel (Q5_0, Q4_K, Q5_K, Q6_K),
 * included there under PQ_LANES8 after the layout's helpers (pkw_header, pkw_run_bytes, pkw_tile_bytes, pkw_runs,
 * pkw_scales, pkw_k_bytes, pkw_q6_codes, PKW_TILE, PKW_PREFETCH, PKW_INLINE) it reads: a group's 16 rows in two
 * 8-row halves s, vpmaddwd + vpaddd (vpdpwssd with AVX-VNNI) on act_q16.h's int16 activations, the same integer
 * sums and, lane by lane, the same float epilogue as the 16-lane packed_grouped_wide16.h
 * (tests/test_packed_kernels.py). */
#ifndef PAGEDSERVE_CPU_PACKED_GROUPED_WIDE8_H
#define PAGEDSERVE_CPU_PACKED_GROUPED_WIDE8_H

/* Q4_K's dots for up to 2 activation rows with the nibbles masked in place, unshifted: code p of a word (inputs
 * 8c + p, 8c + p + 4) is u 16^p in each int16 (p = 3 alone is shifted, as the top nibble needs no mask), so the
 * products of p = 1 and 2 gather in chains of their own, scaled back at the run's end by exact arithmetic shifts
 * (every term a multiple of 16^p; at most 4 x 2 x 3840 x 32767 < 2^31). Two shifts fewer per 8 inputs and the
 * same integer sums: acc[4r + 2s] the dot, acc[4r + 2s + 1] zero. The run's software prefetch (PKW_PREFETCH
 * ahead) is issued here, one line per 64-byte chunk beside that chunk's loads: as a burst of 4 at the run's start
 * (pkw_rows' loop) the AVX2 build read a 1B model's Q4_K gate/up from memory ~10% slower on one core (10.1 against
 * 11.2 GB/s, benchmarks/packed_token_sweep.py, noisy), at 0.52 of its L2-resident rate where Q8_0 reached ~0.58. */
PKW_INLINE void pkw_dots_q4k(const uint8_t *run, const int16_t *q, int64_t qstride, int R, __m256i *acc) {
    __m256i part[12];  /* [6r + 3s + scale class] */
    for (int i = 0; i < 6 * R; i++) part[i] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i w[2];
        for (int s = 0; s < 2; s++) w[s] = _mm256_loadu_si256((const __m256i *)(run + 64 * c + 32 * s));
        _mm_prefetch((const char *)run + PKW_PREFETCH + 64 * c, _MM_HINT_T0);
        for (int p = 0; p < 4; p++) {
            const int cls = p == 3 ? 0 : p;
            for (int r = 0; r < R; r++) {
                const __m256i pair = _mm256_set1_epi32(pq_pair(q + r * qstride + 8 * c + 2 * p));
                for (int s = 0; s < 2; s++) {
                    const __m256i u = p == 3 ? _mm256_srli_epi16(w[s], 12)
                                             : _mm256_and_si256(w[s], _mm256_set1_epi32(0x000F000F << 4 * p));
                    part[6 * r + 3 * s + cls] = pq_dpwssd(part[6 * r + 3 * s + cls], u, pair);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 2; s++) {
            const __m256i *pt = part + 6 * r + 3 * s;
            acc[4 * r + 2 * s] = _mm256_add_epi32(pt[0], _mm256_add_epi32(_mm256_srai_epi32(pt[1], 4),
                                                                           _mm256_srai_epi32(pt[2], 8)));
            acc[4 * r + 2 * s + 1] = _mm256_setzero_si256();
        }
}

/* Q6_K's dots: acc[4r + 2s + h] = dot(u - 32, q) of input half h (inputs 0-15 / 16-31), tile rows 8s..8s+7, each
 * started at its centring sq (pkw_centring; row r's at sq + r sstride). Up to 2 rows a second chain per sum by
 * the pair's parity: one chain of 8 dots left vpdpwssd's latency exposed. The run's 6 lines are prefetched 2 per
 * half and tile half, beside their loads, as pkw_dots_q4k does (1B ffn_down in memory, one thread, noisy: 19.8 ->
 * 18.6 ms a token on avx2 and avx2_vnni, the head 6.0 -> 5.7). */
PKW_INLINE void pkw_dots_q6k(const uint8_t *run, const int16_t *q, int64_t qstride, const int32_t *sq,
                             int64_t sstride, int R, __m256i *acc) {
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 2; s++) {
            __m256i u[8];
            pkw_q6_codes(run + 192 * h + 32 * s, u);
            for (int l = 0; l < 128; l += 64)
                _mm_prefetch((const char *)run + PKW_PREFETCH + 192 * h + 96 * s + l, _MM_HINT_T0);
            for (int r = 0; r < R; r++) {
                __m256i a = _mm256_set1_epi32(sq[r * sstride + h]), b = _mm256_setzero_si256();
                for (int m = 0; m < 8; m++) {
                    const __m256i pair = _mm256_set1_epi32(pq_pair(q + r * qstride + 16 * h + 2 * m));
                    if (R <= 2 && (m & 1)) b = pq_dpwssd(b, u[m], pair);
                    else a = pq_dpwssd(a, u[m], pair);
                }
                acc[4 * r + 2 * s + h] = R <= 2 ? _mm256_add_epi32(a, b) : a;
            }
        }
}

/* One run's integer dots (Q5_0, Q4_K, Q5_K): acc[4r + 2s + h] for activation row r, tile rows 8s..8s+7 (up to 2
 * rows two chains h by p's parity, summed by the caller). Codes as two int16 per lane in act_q16.h's 4-bit order. */
PKW_INLINE void pkw_dots(int fmt, const uint8_t *run, const int16_t *q, int64_t qstride, int R, __m256i *acc) {
    if (fmt == PK_Q4_K && R <= 2) {
        pkw_dots_q4k(run, q, qstride, R, acc);
        return;
    }
    const __m256i low4 = _mm256_set1_epi32(0x000F000F);
    for (int i = 0; i < 4 * R; i++) acc[i] = _mm256_setzero_si256();
    __m256i hw[2];
    for (int s = 0; s < (fmt == PK_Q4_K ? 0 : 2); s++) hw[s] = _mm256_loadu_si256((const __m256i *)(run + 256 + 32 * s));
    for (int c = 0; c < 4; c++) {
        __m256i w[2];
        for (int s = 0; s < 2; s++) w[s] = _mm256_loadu_si256((const __m256i *)(run + 64 * c + 32 * s));
        for (int p = 0; p < 4; p++) {
            __m256i u[2];
            for (int s = 0; s < 2; s++) {
                /* p = 3: the top nibble of each int16 needs no mask */
                u[s] = p == 3 ? _mm256_srli_epi16(w[s], 12) : _mm256_and_si256(pq_shift32(w[s], 4 * p), low4);
                if (fmt != PK_Q4_K)
                    u[s] = _mm256_or_si256(u[s], _mm256_and_si256(pq_shift32(hw[s], 4 * c + p - 4),
                                                                  _mm256_set1_epi32(0x00100010)));
            }
            /* a second chain only while few rows leave the dot latency exposed: from 3 rows on it spilled */
            const int h = R <= 2 && (p & 1);
            for (int r = 0; r < R; r++) {
                const __m256i pair = _mm256_set1_epi32(pq_pair(q + r * qstride + 8 * c + 2 * p));
                for (int s = 0; s < 2; s++) acc[4 * r + 2 * s + h] = pq_dpwssd(acc[4 * r + 2 * s + h], u[s], pair);
            }
        }
    }
}

/* y[r][16 rows of group] for R activation rows; R and fmt are constants after inlining. */
PKW_INLINE void pkw_rows(int fmt, const uint8_t *tiles, int64_t nb, const float *x, int64_t in, pq_act act,
                         const int32_t *sq, int R, const float *bias, float *y, int64_t out) {
    (void)x, (void)in;
    const int64_t tb = pkw_tile_bytes(fmt), nruns = nb * pkw_runs(fmt);
    __m256 tot[2 * PKW_TILE];
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 2; s++) tot[2 * r + s] = bias ? _mm256_loadu_ps(bias + 8 * s) : _mm256_setzero_ps();
    const int kfmt = fmt == PK_Q4_K || fmt == PK_Q5_K;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tile = tiles + b * tb;
        uint8_t sc[128], mn[128];  /* K formats: pkw_k_bytes */
        __m256 dr[2], nd[2];       /* and their d, -dmin */
        for (int s = 0; s < 2 * kfmt; s++) {
            dr[s] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 16 * s)));
            nd[s] = _mm256_xor_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 32 + 16 * s))),
                                  _mm256_set1_ps(-0.0f));
        }
        if (kfmt) pkw_k_bytes(tile, sc, mn);
        for (int j = 0; j < pkw_runs(fmt); j++) {
            const uint8_t *run = tile + pkw_header(fmt) + j * pkw_run_bytes(fmt);
            const int spread = (fmt == PK_Q4_K && R <= 2) || fmt == PK_Q6_K;  /* the dots prefetch as they load */
            for (int64_t l = 0; l < (spread ? 0 : pkw_run_bytes(fmt)); l += 64)
                _mm_prefetch((const char *)run + PKW_PREFETCH + l, _MM_HINT_T0);
            const int64_t k = b * pkw_runs(fmt) + j;
            __m256i acc[4 * PKW_TILE];
            __m256 d[4], m[2];
            if (fmt == PK_Q6_K) pkw_dots_q6k(run, act.q + 32 * k, 32 * nruns, sq + 2 * k, 2 * nruns, R, acc);
            else pkw_dots(fmt, run, act.q + 32 * k, 32 * nruns, R, acc);
            for (int s = 0; s < 2 * kfmt; s++) {  /* pkw_scales' products from the tile's bytes */
                const __m128i scj = _mm_loadl_epi64((const __m128i *)(sc + 16 * j + 8 * s));
                const __m128i mnj = _mm_loadl_epi64((const __m128i *)(mn + 16 * j + 8 * s));
                d[s] = _mm256_mul_ps(dr[s], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scj)));
                m[s] = _mm256_mul_ps(nd[s], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mnj)));
            }
            if (!kfmt) pkw_scales(fmt, tile, j, d, m);
            for (int r = 0; r < R; r++) {
                const __m256 da = _mm256_set1_ps(act.da[r * nruns + k]), sx = _mm256_set1_ps(act.sx[r * nruns + k]);
                for (int s = 0; s < 2; s++) {
                    __m256 t = tot[2 * r + s];
                    if (fmt == PK_Q6_K) {
                        for (int h = 0; h < 2; h++)
                            t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[4 * r + 2 * s + h]),
                                                _mm256_mul_ps(d[2 * h + s], da), t);
                    } else {
                        const __m256i dot = _mm256_add_epi32(acc[4 * r + 2 * s], acc[4 * r + 2 * s + 1]);
                        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d[s], da), t);
                        t = _mm256_fmadd_ps(m[s], sx, t);
                    }
                    tot[2 * r + s] = t;
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 2; s++) _mm256_storeu_ps(y + r * out + 8 * s, tot[2 * r + s]);
}

#endif
