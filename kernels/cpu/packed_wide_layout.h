/* The sizes of the interleaved-rows layout of Q5_0, Q4_K, Q5_K and Q6_K (packed_grouped_wide.c describes the
 * layout) and their scale decoding, shared by its kernels: packed_grouped_wide.c (few activation rows),
 * packed_grouped_panel.c (many) and packed_grouped_bf16.c (dequantized into the dense grouped bf16 layout). */
#ifndef PAGEDSERVE_CPU_PACKED_WIDE_LAYOUT_H
#define PAGEDSERVE_CPU_PACKED_WIDE_LAYOUT_H

#include "act_q16_dots.h"
#include "packed_blocks.h"

#define PKW_INLINE static inline __attribute__((always_inline))

/* The bytes of the 4-bit plane + high plane of one run, and of a tile's header. */
static inline int64_t pkw_high(int fmt) { return fmt == PK_Q6_K ? 128 : fmt == PK_Q4_K ? 0 : 64; }
static inline int64_t pkw_run_bytes(int fmt) { return 256 + pkw_high(fmt); }
static inline int64_t pkw_header(int fmt) { return fmt == PK_Q5_0 ? 32 : fmt == PK_Q6_K ? 288 : 256; }
static inline int64_t pkw_tile_bytes(int fmt) { return PK_GROUP_ROWS * PK_BLOCK_BYTES[fmt]; }
static inline int pkw_runs(int fmt) { return fmt == PK_Q5_0 ? 1 : 8; }

/* Any grouped format's tile: its runs of 32 inputs, and where run j's codes start (the 32-value formats' tiles are
 * one run each). Inline, not packed_grouped_wide.c's pkw_is_wide: an outside call in a row loop spilled every
 * vector register. */
static inline int pkp_wide(int fmt) { return fmt == PK_Q5_0 || fmt == PK_Q4_K || fmt == PK_Q5_K || fmt == PK_Q6_K; }
static inline int pkp_runs(int fmt) { return pkp_wide(fmt) ? pkw_runs(fmt) : 1; }
static inline int64_t pkp_run_at(int fmt, int j) {
    return pkp_wide(fmt) ? pkw_header(fmt) + j * pkw_run_bytes(fmt) : fmt == PK_Q4_1 ? 64 : 32;
}

/* Q6_K's run: 6 planes of 16 words (word r: tile row r), planes 3h..3h+2 (X0, X1, X2) for input half h. Half h
 * holds the run's input pairs 8h + m (m = 0..7; pair 4c + p = inputs 8c + p and 8c + p + 4, act_q16.h's order), a
 * pair's two codes as the two 16-bit halves of a word: pair 2k at bits 0-5 and pair 2k + 1 at bits 10-15 of X_k
 * (k = 0, 1, 2), and the pairs 6, 7 as v = u6 | u7 << 6 in the spare bits 6-9: v's bits 0-3 in X1, 4-7 in X0,
 * 8-11 in X2. So six pairs take one and or one shift each and the last two ten operations (pkw_q6_codes), where
 * a plane of high bits beside the 4-bit plane took a shift, two masks and an or per pair on top of the nibble's. */
PKW_INLINE int pkw_q6_spare(int nibble) { return nibble == 0 ? 1 : nibble == 1 ? 0 : 2; }

/* Code u (0..63) of input k (0..31) of a Q6_K run into row r's words (`run`: the run's 6 planes), and back. */
static inline void pkw_q6_put(uint8_t *run, int r, int k, int u) {
    const int i = 4 * (k / 8) + k % 4, h = i / 8, m = i % 8, lane = 16 * (k % 8 / 4);
    uint8_t *word[3];
    uint32_t w;
    for (int x = 0; x < 3; x++) word[x] = run + 64 * (3 * h + x) + 4 * r;
    if (m < 6) {
        memcpy(&w, word[m / 2], 4);
        w |= (uint32_t)u << (lane + (m & 1 ? 10 : 0));
        memcpy(word[m / 2], &w, 4);
        return;
    }
    const int v = u << 6 * (m - 6);
    for (int n = 0; n < 3; n++) {
        memcpy(&w, word[pkw_q6_spare(n)], 4);
        w |= (uint32_t)(v >> 4 * n & 15) << (lane + 6);
        memcpy(word[pkw_q6_spare(n)], &w, 4);
    }
}

static inline int pkw_q6_get(const uint8_t *run, int r, int k) {
    const int i = 4 * (k / 8) + k % 4, h = i / 8, m = i % 8, lane = 16 * (k % 8 / 4);
    uint32_t w[3];
    for (int x = 0; x < 3; x++) memcpy(&w[x], run + 64 * (3 * h + x) + 4 * r, 4);
    if (m < 6) return (int)(w[m / 2] >> (lane + (m & 1 ? 10 : 0)) & 63);
    int v = 0;
    for (int n = 0; n < 3; n++) v |= (int)(w[pkw_q6_spare(n)] >> (lane + 6) & 15) << 4 * n;
    return v >> 6 * (m - 6) & 63;
}

#if defined(PQ_LANES8) || defined(PS_AVX512_VNNI)
/* Q4_K/Q5_K: a tile's 6-bit scales and mins as bytes (run j's 16 rows at 16 j), for the few-row kernels: decoded
 * once per tile instead of per run and pass of activation rows, where they cost ~12-15% of Q4_K's one-row time
 * (AVX2, L2-resident). The same integers as pkw_scales'. */
PKW_INLINE void pkw_k_bytes(const uint8_t *tile, uint8_t *sc, uint8_t *mn) {
    for (int i = 0; i < 4; i++) {  /* runs 2i, 2i + 1 */
        const __m256i a = _mm256_loadu_si256((const __m256i *)(tile + 64 + 32 * i));
        const __m128i l = _mm_loadu_si128((const __m128i *)(tile + 192 + 16 * i));
        const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(l, 4), l), _mm256_set1_epi8(15));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(a, 2), _mm256_set1_epi8(0x30));
        _mm256_storeu_si256((__m256i *)(sc + 32 * i), _mm256_and_si256(a, _mm256_set1_epi8(63)));
        _mm256_storeu_si256((__m256i *)(mn + 32 * i), _mm256_or_si256(lo, hi));
    }
}
#endif

#if defined(PQ_LANES8)
/* Q6_K: the codes of one input half's 8 pairs (run + 192 h + 32 s: tile rows 8s..8s+7) as u[m], uncentred. */
PKW_INLINE void pkw_q6_codes(const uint8_t *at, __m256i *u) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)at), x1 = _mm256_loadu_si256((const __m256i *)(at + 64));
    const __m256i x2 = _mm256_loadu_si256((const __m256i *)(at + 128)), low6 = _mm256_set1_epi32(0x003F003F);
    u[0] = _mm256_and_si256(x0, low6), u[1] = _mm256_srli_epi16(x0, 10);
    u[2] = _mm256_and_si256(x1, low6), u[3] = _mm256_srli_epi16(x1, 10);
    u[4] = _mm256_and_si256(x2, low6), u[5] = _mm256_srli_epi16(x2, 10);
    const __m256i v = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x1, 6), _mm256_set1_epi32(0x000F000F)),
                        _mm256_and_si256(_mm256_srli_epi16(x0, 2), _mm256_set1_epi32(0x00F000F0))),
        _mm256_and_si256(_mm256_slli_epi16(x2, 2), _mm256_set1_epi32(0x0F000F00)));
    u[6] = _mm256_and_si256(v, low6), u[7] = _mm256_srli_epi16(v, 6);
}

/* Run j's scales of tile rows 8s..8s+7: d[s] (Q6_K: d[2h + s] per input half h) and m[s]. */
PKW_INLINE void pkw_scales(int fmt, const uint8_t *tile, int j, __m256 *d, __m256 *m) {
    for (int s = 0; s < 2; s++) {
        const __m256 dr = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 16 * s)));
        if (fmt == PK_Q5_0) {
            d[s] = dr, m[s] = _mm256_mul_ps(dr, _mm256_set1_ps(-16.0f));
        } else if (fmt == PK_Q6_K) {
            for (int h = 0; h < 2; h++) {
                const __m128i sc = _mm_loadl_epi64((const __m128i *)(tile + 32 + 16 * (2 * j + h) + 8 * s));
                d[2 * h + s] = _mm256_mul_ps(dr, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
            }
        } else {
            const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(tile + 64 + 16 * j + 8 * s)));
            const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(tile + 192 + 16 * (j / 2) + 8 * s)));
            const __m256i sc = _mm256_and_si256(a, _mm256_set1_epi32(63));
            const __m256i mn = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(lo, 4 * (j & 1)), _mm256_set1_epi32(15)),
                                               _mm256_slli_epi32(_mm256_srli_epi32(a, 6), 4));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 32 + 16 * s)));
            d[s] = _mm256_mul_ps(dr, _mm256_cvtepi32_ps(sc));
            m[s] = _mm256_mul_ps(_mm256_xor_ps(dmin, _mm256_set1_ps(-0.0f)), _mm256_cvtepi32_ps(mn));
        }
    }
}
#elif defined(PS_AVX512_VNNI)
/* pkw_q6_codes for the 16 rows (run + 192 h), v's three parts merged by bit selects. */
PKW_INLINE void pkw_q6_codes(const uint8_t *at, __m512i *u) {
    const __m512i x0 = _mm512_loadu_si512(at), x1 = _mm512_loadu_si512(at + 64), x2 = _mm512_loadu_si512(at + 128);
    const __m512i low6 = _mm512_set1_epi32(0x003F003F);
    u[0] = _mm512_and_si512(x0, low6), u[1] = _mm512_srli_epi16(x0, 10);
    u[2] = _mm512_and_si512(x1, low6), u[3] = _mm512_srli_epi16(x1, 10);
    u[4] = _mm512_and_si512(x2, low6), u[5] = _mm512_srli_epi16(x2, 10);
    /* 0xE4: c ? a : b per bit */
    __m512i v = _mm512_ternarylogic_epi32(_mm512_srli_epi16(x1, 6), _mm512_srli_epi16(x0, 2),
                                          _mm512_set1_epi32(0x000F000F), 0xE4);
    v = _mm512_ternarylogic_epi32(_mm512_slli_epi16(x2, 2), v, _mm512_set1_epi32(0x0F000F00), 0xE4);
    u[6] = _mm512_and_si512(v, low6), u[7] = _mm512_and_si512(_mm512_srli_epi16(v, 6), low6);
}

/* Run j's scales of the tile's 16 rows: d[0] (Q6_K: d[h] per input half h) and m[0]. */
PKW_INLINE void pkw_scales(int fmt, const uint8_t *tile, int j, __m512 *d, __m512 *m) {
    const __m512 dr = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tile));
    if (fmt == PK_Q5_0) {
        d[0] = dr, m[0] = _mm512_mul_ps(dr, _mm512_set1_ps(-16.0f));
    } else if (fmt == PK_Q6_K) {
        for (int h = 0; h < 2; h++) {
            const __m128i sc = _mm_loadu_si128((const __m128i *)(tile + 32 + 16 * (2 * j + h)));
            d[h] = _mm512_mul_ps(dr, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        }
    } else {
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tile + 64 + 16 * j)));
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tile + 192 + 16 * (j / 2))));
        const __m512i sc = _mm512_and_si512(a, _mm512_set1_epi32(63));
        const __m512i mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(lo, 4 * (j & 1)), _mm512_set1_epi32(15)),
                                           _mm512_slli_epi32(_mm512_srli_epi32(a, 6), 4));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 32)));
        d[0] = _mm512_mul_ps(dr, _mm512_cvtepi32_ps(sc));
        m[0] = _mm512_mul_ps(_mm512_xor_ps(dmin, _mm512_set1_ps(-0.0f)), _mm512_cvtepi32_ps(mn));
    }
}
#endif

#endif
