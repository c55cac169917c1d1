/* GGUF weight blocks as pagedserve's packed kernels read them, in place, in the file's own layout.
 *
 * Every format is seen as runs of 32 unsigned codes u (0..255) with, per 16-value half, a scale d and an offset m:
 * w = d * u + m. A Q8_0 code is its int8 value + 128 (m = -128 d); Q6_K keeps its per-16 scales (m = -32 d sc);
 * the K formats' 256-value super-blocks are 8 such runs whose scales are decoded once per super-block. With
 * activations quantized per 32 to int8 (x ~ a * q), a run's dot product is an integer dot of u and q, scaled by
 * d * a, plus m * a * sum(q): the integer part is what VNNI's vpdpbusd (u8 x s8) computes.
 * Layouts follow ggml-common.h (read through gguf-py's dequantizers, which the tests compare against). */
#ifndef PAGEDSERVE_CPU_PACKED_BLOCKS_H
#define PAGEDSERVE_CPU_PACKED_BLOCKS_H

#include "isa.h"
#include <stdint.h>
#include <string.h>

enum { PK_Q4_0 = 0, PK_Q4_1 = 1, PK_Q5_0 = 2, PK_Q8_0 = 3, PK_Q4_K = 4, PK_Q5_K = 5, PK_Q6_K = 6, PK_NUM_FORMATS = 7 };

/* Values per storage block, bytes per storage block, runs of 32 per storage block. */
static const int64_t PK_BLOCK_VALUES[PK_NUM_FORMATS] = {32, 32, 32, 32, 256, 256, 256};
static const int64_t PK_BLOCK_BYTES[PK_NUM_FORMATS] = {18, 20, 22, 34, 144, 176, 210};

/* Scales and offsets of every run of one storage block, per 16-value half: [run][0 or 1]. */
typedef struct {
    float d[8][2];
    float m[8][2];
} pk_scales;

#if defined(PS_AVX2)
static inline float pk_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#else
static inline float pk_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  /* subnormal half: normalize */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

static inline void pk_set(pk_scales *s, int run, float d, float m) {
    s->d[run][0] = s->d[run][1] = d;
    s->m[run][0] = s->m[run][1] = m;
}

/* The K formats' 6-bit scale and min of run j (ggml's get_scale_min_k4). */
static inline void pk_scale_min_k4(const uint8_t *q, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Decodes one storage block's scales; returns its number of runs. */
static inline int pk_block_scales(int fmt, const uint8_t *b, pk_scales *s) {
    switch (fmt) {
    case PK_Q4_0: pk_set(s, 0, pk_half(b), -8.0f * pk_half(b)); return 1;
    case PK_Q4_1: pk_set(s, 0, pk_half(b), pk_half(b + 2)); return 1;
    case PK_Q5_0: pk_set(s, 0, pk_half(b), -16.0f * pk_half(b)); return 1;
    case PK_Q8_0: pk_set(s, 0, pk_half(b), -128.0f * pk_half(b)); return 1;
    case PK_Q4_K:
    case PK_Q5_K: {
        float d = pk_half(b), dmin = pk_half(b + 2);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            pk_scale_min_k4(b + 4, j, &sc, &mn);
            pk_set(s, j, d * (float)sc, -dmin * (float)mn);
        }
        return 8;
    }
    default: {  /* Q6_K: int8 scales per 16 values, d at byte 208 */
        float d = pk_half(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int j = 0; j < 8; j++) {
            for (int h = 0; h < 2; h++) {
                s->d[j][h] = d * (float)sc[2 * j + h];
                s->m[j][h] = -32.0f * s->d[j][h];
            }
        }
        return 8;
    }
    }
}

/* The 32 codes of run j of storage block b, portable C. */
static inline void pk_codes_scalar(int fmt, const uint8_t *b, int j, uint8_t *u) {
    switch (fmt) {
    case PK_Q4_0:
    case PK_Q4_1: {
        const uint8_t *qs = b + (fmt == PK_Q4_0 ? 2 : 4);
        for (int l = 0; l < 16; l++) { u[l] = qs[l] & 0xF; u[l + 16] = qs[l] >> 4; }
        return;
    }
    case PK_Q5_0: {
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        for (int l = 0; l < 16; l++) {
            u[l] = (b[6 + l] & 0xF) | (((qh >> l) & 1) << 4);
            u[l + 16] = (b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
        }
        return;
    }
    case PK_Q8_0:
        for (int l = 0; l < 32; l++) u[l] = (uint8_t)(b[2 + l] ^ 0x80);
        return;
    case PK_Q4_K:
    case PK_Q5_K: {
        const uint8_t *qs = b + (fmt == PK_Q4_K ? 16 : 48) + 32 * (j / 2), *qh = b + 16;
        for (int l = 0; l < 32; l++) {
            u[l] = (qs[l] >> (4 * (j & 1))) & 0xF;
            if (fmt == PK_Q5_K) u[l] |= ((qh[l] >> j) & 1) << 4;
        }
        return;
    }
    default: {  /* Q6_K: half n = j / 4, group g = j % 4 of that half */
        int n = j / 4, g = j % 4;
        const uint8_t *ql = b + 64 * n + 32 * (g & 1), *qh = b + 128 + 32 * n;
        for (int l = 0; l < 32; l++) u[l] = ((ql[l] >> (4 * (g >> 1))) & 0xF) | (((qh[l] >> (2 * g)) & 3) << 4);
        return;
    }
    }
}

/* One packed matrix as the kernels read it (packed_linear.c, packed_dequantize.c). */
typedef struct {
    int32_t format;       /* PK_* of packed_blocks.h */
    int32_t num_threads;  /* for calls through ps_linear_fn; 0: the calling thread's omp_get_max_threads() */
    int64_t in_features, out_features;
    const uint8_t *data;  /* [out_features, row_bytes]: each row's storage blocks, in order */
    int64_t row_bytes;
    const float *bias;    /* [out_features] or NULL */
    int32_t int8_max_rows;  /* calls with up to this many rows round x to int8 blocks; more: fp32 (packed_f32.c) */
    int32_t row_group;      /* 0: the file's layout; PK_GROUP_ROWS: rows interleaved (packed_grouped.c, _wide.c) */
} ps_packed_state;

/* Output rows per group of the interleaved layout: one AVX-512 register holds one value of each. */
#define PK_GROUP_ROWS 16

/* The formats with an interleaved layout: all of them (packed_grouped.c: Q4_0/Q4_1/Q8_0; packed_grouped_wide.c:
 * Q5_0 and the K formats). */
static inline int pk_groupable(int fmt) { return fmt >= 0 && fmt < PK_NUM_FORMATS; }

/* Nonzero when the state does not describe whole blocks. */
static inline int pk_check(const ps_packed_state *st) {
    if (st == NULL || st->format < 0 || st->format >= PK_NUM_FORMATS) return 1;
    int64_t per = PK_BLOCK_VALUES[st->format];
    if (st->in_features <= 0 || st->in_features % per || st->out_features <= 0) return 1;
    if (st->row_group != 0 && (st->row_group != PK_GROUP_ROWS || st->out_features % PK_GROUP_ROWS ||
                               !pk_groupable(st->format)))
        return 1;
    return st->row_bytes != st->in_features / per * PK_BLOCK_BYTES[st->format];
}

#if defined(PS_AVX2)

/* Byte l of the result is 0xFF where bit l of x is set (x: 32 bits). */
static inline __m256i pk_bits_to_bytes(uint32_t x) {
    const __m256i shuf = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

/* The 32 codes of run j of storage block b in one register (same values as pk_codes_scalar). */
static inline __m256i pk_codes_avx2(int fmt, const uint8_t *b, int j) {
    const __m256i low4 = _mm256_set1_epi8(0xF);
    switch (fmt) {
    case PK_Q4_0:
    case PK_Q4_1:
    case PK_Q5_0: {
        __m128i q = _mm_loadu_si128((const __m128i *)(b + (fmt == PK_Q4_0 ? 2 : fmt == PK_Q4_1 ? 4 : 6)));
        __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low4);
        if (fmt == PK_Q5_0) {
            uint32_t qh;
            memcpy(&qh, b + 2, 4);
            u = _mm256_or_si256(u, _mm256_and_si256(pk_bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
        }
        return u;
    }
    case PK_Q8_0:
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
    case PK_Q4_K:
    case PK_Q5_K: {
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + (fmt == PK_Q4_K ? 16 : 48) + 32 * (j / 2)));
        __m256i u = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(4 * (j & 1))), low4);
        if (fmt == PK_Q5_K) {
            __m256i h = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)), _mm_cvtsi32_si128(j));
            u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(1)), 4));
        }
        return u;
    }
    default: {
        int n = j / 4, g = j % 4;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32 * (g & 1)));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
        __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (g >> 1))), low4);
        __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    }
}
#endif

/* Row r's 32 codes, in input order, from the 4-bit codes of one interleaved tile (GGUF Q4_0/Q4_1 in
 * packed_grouped.c, GPTQ/AWQ in group_grouped.c): 4 chunks of 64 bytes, chunk c's 32-bit word r holding
 * inputs 8c..8c+7 one nibble each. Row r's four words, read in chunk order, are 16 bytes whose byte j holds inputs
 * 2j (low nibble) and 2j + 1. */
static inline void pk_tile4_codes(const uint8_t *codes, int r, uint8_t *u) {
    uint8_t q[16];
    for (int c = 0; c < 4; c++) memcpy(q + 4 * c, codes + 64 * c + 4 * r, 4);
#if defined(PS_AVX2)
    const __m128i low4 = _mm_set1_epi8(0xF), v = _mm_loadu_si128((const __m128i *)q);
    const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
    _mm_storeu_si128((__m128i *)u, _mm_unpacklo_epi8(lo, hi));
    _mm_storeu_si128((__m128i *)(u + 16), _mm_unpackhi_epi8(lo, hi));
#else
    for (int j = 0; j < 16; j++) u[2 * j] = q[j] & 0xF, u[2 * j + 1] = q[j] >> 4;
#endif
}

#endif
