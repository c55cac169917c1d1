/* Activations rounded to int16 per 32-input block for the interleaved-row kernels (packed_grouped.c: GGUF
 * Q4_0/Q4_1/Q8_0; group_grouped.c: GPTQ/AWQ 4/8-bit), in 16 lanes on AVX512-VNNI and 8-lane halves on AVX2 (with
 * AVX-VNNI where present; PQ_INT16 below); their integer tile products are act_q16_dots.h.
 *
 * Why: with fp32 activations those kernels spend, per 16 rows x 32 inputs, 32 FMAs per activation row plus 64
 * shifts and vpermps widening the codes, so 4 rows cost ~2x one row and 8 rows ~4x: the price of speculative
 * verification (k + 1 rows per stream) and of small-batch decode. With x ~ da q per block (q = rint(x / da)) a
 * block's 16-row dot is integer work: 16 vpdpwssd (s16 x s16 pairs -> int32) per activation row, and one int->float
 * conversion and FMA with d da; the codes are widened once per tile for all rows (16 shift/and pairs for 4-bit).
 *
 * Why int16 and not llama.cpp's int8 (vpdpbusd, half the dot instructions): measured on SmolLM2-135M Q4_1/Q8_0
 * through tests/test_packed_engine.py, int8 activations (da = max|x| / 127) moved the fp32 top-1 agreement with the
 * dequantized model to 91% (95% with the offset term rounded alike) against >= 99% required, bf16 perplexity +1.7%
 * and greedy continuations 1 of 8 identical; int16 (da = max|x| / 32767) keeps them at the fp32 kernel's figures.
 *
 * Numerics: int32 sums are exact (|sum| < 2^31: 16 pairs x 255 x 32767 x 2), so a row's result is the same whatever
 * rows are beside it and however its integer sums are split; the float epilogue per row is the same instructions
 * for every number of rows. Only the code term is rounded: the offset term m sum(x) keeps the exact fp32 block
 * sums (sx). Per output, with w = d u + m:
 *     |y - x W^T| <= sum over blocks b of (da_b / 2) sum_{k in b} |d_b u_k|  +  the fp32 summation error,
 * |d u| being |w| for the signed codes (Q8_0: m = 0) and |w - m| otherwise (tests/test_packed_kernels.py and
 * tests/test_group_kernel.py assert it).
 *
 * Order of q within a block, to match the tiles: a 4-bit tile's chunk c word r holds row r's inputs 8c..8c+7
 * (input 8c + p in bits 4p..4p+3), so (word >> 4p) & 0x000F000F holds inputs 8c + p and 8c + p + 4 as two int16:
 * element 8c + 2p + h of the block is input 8c + p + 4h. An 8-bit tile's 64 bytes of inputs 4c..4c+3 x 16 rows are
 * gathered with one vpermb into row r's pairs of consecutive inputs (layout unchanged: one instruction per 64
 * bytes shared by all activation rows; re-laying the tiles at load would move every reader of the layout), so
 * the 8-bit order is the natural one. */
#ifndef PAGEDSERVE_CPU_ACT_Q16_H
#define PAGEDSERVE_CPU_ACT_Q16_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"

#define PQ_INLINE static inline __attribute__((always_inline))

/* Rounded activations of `rows` rows, `blocks` blocks of 32 each; [row * blocks + b] indexing. */
typedef struct {
    int16_t *q;  /* [rows, blocks, 32] in the tiles' order (pq_quantize) */
    float *da;   /* the block's scale: x ~ da q */
    float *sx;   /* the exact fp32 sum of x over the block (the offset term's) */
} pq_act;

/* One buffer for the three arrays (pq_free releases it). Returns nonzero when out of memory. */
static inline int pq_alloc(pq_act *act, int64_t rows, int64_t blocks) {
    const size_t n = (size_t)(rows * blocks);
    char *mem = malloc(n * (64 + 2 * 4) + 64);
    if (mem == NULL) return 1;
    act->da = (float *)mem;
    act->sx = act->da + n;
    act->q = (int16_t *)(act->sx + n);
    return 0;
}

static inline void pq_free(pq_act *act) { free(act->da); }

/* The arrays from activation row r0 on. */
static inline pq_act pq_rows(const pq_act *act, int64_t r0, int64_t blocks) {
    return (pq_act){act->q + 32 * r0 * blocks, act->da + r0 * blocks, act->sx + r0 * blocks};
}

/* Every build with AVX2 takes these int16 activations in its interleaved-rows kernels: AVX512-VNNI (vpdpwssd, 16
 * lanes) and the rest in 8 lanes: AVX2 with AVX-VNNI (vpdpwssd), plain AVX2 and the AVX-512 tier without VNNI+VBMI
 * (Skylake-SP, Cascade Lake: vpmaddwd + vpaddd), the same exact int32 sums. Every one of them rounds, sums and
 * scales alike, so a grouped kernel's result is the same bit for bit on every tier (tests/test_packed_kernels.py),
 * and each has the many-row panel kernel, so no tier needs a dense copy of a GGUF matrix for prefill. */
#if defined(PS_AVX512_VNNI)
#define PQ_INT16 "avx512_vnni"
#elif defined(PS_AVX512)
#define PQ_INT16 "avx512"
#define PQ_LANES8 1
#elif defined(PS_AVX2_VNNI)
#define PQ_INT16 "avx2_vnni"
#define PQ_LANES8 1
#elif defined(PS_AVX2)
#define PQ_INT16 "avx2"
#define PQ_LANES8 1
#endif

#if defined(PQ_INT16)
/* The sum of 16 lanes (lo: lanes 0-7, hi: 8-15) as a fixed tree: lanes j and j + 8, then j + 4, j + 2, j + 1
 * (the tree gcc's _mm512_reduce_add_ps uses), the same in every build. */
PQ_INLINE float pq_sum16(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(hi, lo);
    const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
    const __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}
#endif

#if defined(PS_AVX512_VNNI)
/* One block: 32 inputs -> da, sx and 32 int16 codes (order4: the 4-bit tiles' order, else the natural one), in
 * vectors: the scalar loop (a serial sum, a rounding and a scattered store per input) was ~5% of a speculative
 * step. The sum is a fixed tree (inputs k and k + 16, then pq_sum16), the same for every row, so rows stay
 * independent. */
PQ_INLINE void pq_quantize_block(const float *v, int order4, int16_t *q, float *da, float *sx) {
    const __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
    /* max_ps returns its second operand when either is NaN: a NaN input never becomes the maximum */
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 pairs = _mm512_add_ps(lo, hi);
    const float sum = pq_sum16(_mm512_castps512_ps256(pairs), _mm512_extractf32x8_ps(pairs, 1));
    /* a NaN or inf in the block makes the sum non-finite: its rows' outputs are NaN, as the fp32 kernels give */
    const int finite = isfinite(sum);
    const __m512 inv = _mm512_set1_ps(finite && amax > 0.0f ? 32767.0f / amax : 0.0f);
    const __m256i qlo = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)));
    const __m256i qhi = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inv)));
    __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(qlo), qhi, 1);
    if (order4) {  /* element 8c + 2p + h <- input 8c + p + 4h */
        const __m512i from = _mm512_set_epi16(31, 27, 30, 26, 29, 25, 28, 24, 23, 19, 22, 18, 21, 17, 20, 16,
                                              15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6, 2, 5, 1, 4, 0);
        codes = _mm512_permutexvar_epi16(from, codes);
    }
    _mm512_storeu_si512(q, finite ? codes : _mm512_setzero_si512());
    *sx = sum;
    *da = finite ? amax / 32767.0f : NAN;
}
#elif defined(PQ_LANES8)
/* The same block in 8-lane vectors: the same maximum, sum tree, rounding (nearest even) and saturation. */
PQ_INLINE __m256i pq_round16(__m256 a, __m256 b, __m256 inv) {  /* 16 inputs -> 16 int16, in input order */
    const __m256i packed = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(a, inv)),
                                              _mm256_cvtps_epi32(_mm256_mul_ps(b, inv)));
    return _mm256_permute4x64_epi64(packed, 0xD8);  /* packs interleaves the 128-bit halves */
}

PQ_INLINE void pq_quantize_block(const float *v, int order4, int16_t *q, float *da, float *sx) {
    const __m256 a0 = _mm256_loadu_ps(v), a1 = _mm256_loadu_ps(v + 8);
    const __m256 b0 = _mm256_loadu_ps(v + 16), b1 = _mm256_loadu_ps(v + 24), sign = _mm256_set1_ps(-0.0f);
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1)),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, b0), _mm256_andnot_ps(sign, b1)));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m8, 1), _mm256_castps256_ps128(m8));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const float sum = pq_sum16(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1));
    const int finite = isfinite(sum);
    const __m256 inv = _mm256_set1_ps(finite && amax > 0.0f ? 32767.0f / amax : 0.0f);
    __m256i lo = pq_round16(a0, a1, inv), hi = pq_round16(b0, b1, inv);
    if (order4) {  /* per 8 inputs (one 128-bit half): element 2p + h <- input p + 4h */
        lo = _mm256_unpacklo_epi16(lo, _mm256_srli_si256(lo, 8));
        hi = _mm256_unpacklo_epi16(hi, _mm256_srli_si256(hi, 8));
    }
    _mm256_storeu_si256((__m256i *)q, finite ? lo : _mm256_setzero_si256());
    _mm256_storeu_si256((__m256i *)(q + 16), finite ? hi : _mm256_setzero_si256());
    *sx = sum;
    *da = finite ? amax / 32767.0f : NAN;
}
#endif

/* Rows [begin, end) of x [rows, 32 blocks]; order4: the 4-bit tiles' order, else the natural one. Builds without
 * int16 kernels read only the sums, which they add in input order, as the fp32 kernels always did. */
static inline void pq_quantize(const float *x, int64_t blocks, int64_t begin, int64_t end, int order4, pq_act *act) {
    for (int64_t i = begin * blocks; i < end * blocks; i++) {
#if defined(PQ_INT16)
        pq_quantize_block(x + 32 * i, order4, act->q + 32 * i, act->da + i, act->sx + i);
#else
        float sum = 0.0f;
        for (int k = 0; k < 32; k++) sum += x[32 * i + k];
        act->sx[i] = sum;
        (void)order4;
#endif
    }
}

#if defined(PQ_INT16)
/* 2 int16 activations as the dword a vpdpwssd broadcasts (memcpy: no aliasing of the int16 buffer) */
PQ_INLINE int32_t pq_pair(const int16_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return v;
}
#endif

#endif
