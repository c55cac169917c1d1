/* What the two bf16-query prefill paths share (prefill_dpbf16.c: vdpbf16ps; prefill_amx.c: AMX tiles): the
 * task's queries as dimension pairs over row lanes, one K or V row widened or dequantized to bf16, and the
 * lane-wise online softmax. Row lane r of a task: position j0 + r / group, head h * group + r % group. */
#ifndef PAGEDSERVE_CPU_PREFILL_BF16_H
#define PAGEDSERVE_CPU_PREFILL_BF16_H

#include "prefill_attention.h"

#if defined(PS_AVX512_BF16)

/* The task's queries as dimension pairs over rows, q[p * rp + r], rows padded to rp (a multiple of 16) with zero
 * queries at the last row's position; positions in pos[r]; m, l and acc reset. Returns rp. */
INLINE int64_t load_queries(const PrefillArgs *a, const Task *t, Tile *w, const int64_t dim) {
    const int64_t group = a->num_heads / a->num_kv_heads, rows = t->rows * group, rp = (rows + 15) / 16 * 16;
    const int64_t first = a->seq_lens[t->s] - a->query_lens[t->s] + t->j0;
    uint32_t *q = (uint32_t *)w->q;
    int32_t *pos = (int32_t *)w->correction;
    for (int64_t r = 0; r < rp; r++) {
        const int64_t row = a->rows[t->s] + t->j0 + r / group, head = t->h * group + r % group;
        const uint32_t *src = (const uint32_t *)((const uint16_t *)a->query + row * a->q_token_stride + head * dim);
        for (int64_t p = 0; p < dim / 2; p++) q[p * rp + r] = r < rows ? src[p] : 0;
        pos[r] = (int32_t)(first + (r < rows ? r : rows - 1) / group);
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * (size_t)(dim * rp));
    return rp;
}

/* One cache row as bf16 into dst: a bf16 row copied, an FP8 one widened, an int8 one times its scale `rs`, each
 * rounded as the torch path's gather rounds it. */
INLINE void bf16_row(const char *row, float rs, const int64_t dim, const int kv_dt, uint16_t *dst) {
    if (kv_dt == DT_BF16) {
        memcpy(dst, row, sizeof(uint16_t) * (size_t)dim);
        return;
    }
    for (int64_t c = 0; c < dim / 16; c++) {
        f32x16 x = load16(row, c, kv_dt);
        if (kv_dt == DT_I8) x *= rs;
        const u16x16 bits = bf16x16_bits(x);
        memcpy(dst + 16 * c, &bits, sizeof bits);
    }
}

/* e^x for x <= 0 as 2^(x log2 e) = 2^f * 2^n with |f| <= 1/2 (a degree-5 polynomial, ~1e-6 relative: the result is
 * rounded to bf16) and vscalefps for 2^n; x below -87 or NaN gives e^-87 (callers zero those lanes). */
INLINE __m512 exp_bf16(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.3333558e-3f), f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Online-softmax update of 16 row lanes for keys [k0, k0 + n): raw scores s[i * rp] times `factor` (> 0), masked by
 * each lane's position (and window) unless `whole` (every lane sees every key), become bf16 probabilities stored in
 * place as pairs (key 2 i2 low, 2 i2 + 1 high) at s[i2 * rp]. Returns the factor the lanes' accumulators must be
 * scaled by. P is rounded to bf16 before P x V, as torch's own CPU flash attention rounds it, and the row sums add
 * the rounded values (one vdpbf16ps against pairs of ones), so each output row stays a convex combination of V
 * rows. The running max m is in scaled units. */
INLINE __m512 softmax_block(float *s, float *m, float *l, const int32_t *pos, float factor, int64_t k0, int64_t n,
                            int64_t window, const int64_t rp, int whole) {
    const __m512i position = _mm512_loadu_si512(pos);
    const __m512i lo = window > 0 ? _mm512_sub_epi32(position, _mm512_set1_epi32((int)window - 1))
                                  : _mm512_set1_epi32(INT32_MIN);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(factor);
    __m512 peak = neg_inf;
    for (int64_t i = 0; i < n; i++) {
        __m512 x = _mm512_load_ps(s + i * rp);
        if (!whole) {
            const __m512i key = _mm512_set1_epi32((int)(k0 + i));
            x = _mm512_mask_mov_ps(neg_inf, _mm512_cmple_epi32_mask(key, position) & _mm512_cmpge_epi32_mask(key, lo),
                                   x);
            _mm512_store_ps(s + i * rp, x);
        }
        peak = _mm512_max_ps(peak, x);
    }
    const __m512 old_max = _mm512_load_ps(m), new_max = _mm512_max_ps(old_max, _mm512_mul_ps(peak, scale));
    f32x16 diff;
    _mm512_storeu_ps((float *)&diff, _mm512_sub_ps(old_max, new_max));
    /* 1 where the max stayed (also -inf to -inf, whose difference is NaN) */
    const __m512 correction = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(old_max, new_max, _CMP_EQ_OQ),
                                                   (__m512)exp16_nonpositive(diff), _mm512_set1_ps(1.0f));
    const __m512 shift = _mm512_sub_ps(_mm512_setzero_ps(), new_max);
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ones = _mm512_set1_epi32(0x3f803f80);  /* (1.0, 1.0) in bf16 */
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i2 = 0; 2 * i2 < n; i2++) {
        __m512 p[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t e = 0; e < 2 && 2 * i2 + e < n; e++) {
            const __m512 x = _mm512_load_ps(s + (2 * i2 + e) * rp);
            /* masked lanes are -inf: zero, also where new_max is -inf too */
            p[e] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ),
                                       exp_bf16(_mm512_fmadd_ps(x, scale, shift)));
        }
        const __m512i pair = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
        sum = _mm512_dpbf16_ps(sum, (__m512bh)pair, (__m512bh)ones);
        _mm512_store_si512(s + i2 * rp, pair);
    }
    _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), correction, sum));
    _mm512_store_ps(m, new_max);
    return correction;
}

/* The task's rows normalized into `out`. */
INLINE void store_rows(const PrefillArgs *a, const Task *t, const Tile *w, const int64_t rp, const int64_t dim) {
    const int64_t group = a->num_heads / a->num_kv_heads, rows = t->rows * group;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = a->rows[t->s] + t->j0 + r / group, head = t->h * group + r % group;
        uint16_t *dst = (uint16_t *)a->out + (row * a->num_heads + head) * dim;
        const float factor_out = a->v_scale[t->h] / w->l[r];
        for (int64_t d = 0; d < dim; d++) dst[d] = f32_to_bf16(w->acc[d * rp + r] * factor_out);
    }
}

#endif
#endif
