/* Q4_0/Q4_1/Q8_0 matrices (the other formats: packed_grouped_wide.c, called from here) with their rows interleaved in groups of PK_GROUP_ROWS (ps_packed_state.row_group): the
 * layout the one-to-eight-row product reads fastest, made once at load by pagedserve_packed_group_rows.
 *
 * Why: in the file's layout each 32-weight block of one row needs its scales converted and broadcast and its
 * nibbles widened lane by lane, ~9 cycles per block, so a single stream's linears ran at 4-10 GB/s: bound by
 * instructions, not by reading the weights. With 16 rows side by side one AVX-512 register holds one input's code
 * for all 16 rows and each block's scales are one vector per group.
 *
 * Builds, chosen at compile time by the ISA tier (isa.h; the tests build each): "avx512_vnni" (AVX512-VNNI and
 * VBMI: Ice Lake and later, Zen 4) rounds the activations to int16 per block (act_q16.h) and takes a block's
 * 16-row dots as 16 vpdpwssd per activation row: extra rows (speculative verification, small batches) cost ~20
 * instructions per block each instead of ~36, and the codes are widened with half the instructions. "avx2_vnni"
 * and "avx2" take the same int16 activations and the same integer dots in two 8-row halves (vpdpwssd ymm with
 * AVX-VNNI, vpmaddwd + vpaddd without: Zen 1-3, Haswell to Skylake client), with the same float epilogue, so
 * their results equal the avx512_vnni build's bit for bit; so does "avx512" (AVX-512 without VNNI+VBMI: Skylake-SP,
 * Cascade Lake), which runs the 8-lane kernel too (it beat the 16-lane fp32 FMA kernel it replaced, noisy, and
 * serves every format). "portable": C loops, fp32. Per block every build adds d * sum(u x) + m * sum(x) with the exact fp32 sum(x);
 * act_q16.h states the int16 rounding's bound.
 *
 * Layout, same bytes as the file's: group g = rows 16g..16g+15, stored in place of those rows. Per block b (32
 * inputs) one tile: the 16 rows' d (fp16, 32 bytes), for Q4_1 their m (fp16, 32 bytes), then the codes. 4-bit: 4
 * chunks of 64 bytes where chunk c's 32-bit word r holds row r's codes of inputs 8c..8c+7, input 8c+p in bits
 * 4p..4p+3. Q8_0: 32 chunks of 16 bytes, chunk k holding the 16 rows' int8 codes of input k (one vpmovsxbd each). */
#include "isa.h"
#include <omp.h>

#include "act_q16_dots.h"
#include "packed_blocks.h"

#define PK_EXPORT __attribute__((visibility("default")))
#define PK_INLINE static inline __attribute__((always_inline))
#if defined(PQ_LANES8)
#define PK_GROUP_TILE 4  /* activation rows per pass over a group's weights: 16 registers hold 4 rows' sums */
#else
#define PK_GROUP_TILE 8
#endif
/* Software prefetch distance, in tiles (~1-2 KiB: 4 x 288-544 bytes). The hardware prefetcher alone left a stream
 * at 7-12 GB/s per matrix. 8 tiles ahead (chosen on SmolLM2's shapes) read a 1B model's Q8_0 linears from memory at
 * 10.9 GB/s on one core of the SPR host, AVX2 build; 2-4 tiles ahead at 13.0, the AVX512-VNNI build 11.9 -> 13.8
 * and Q4_0 9.7 -> 10.2 (benchmarks/packed_token_sweep.py; 5 or more ahead and the L2 hint were slower). 1-2 KiB is
 * far inside any L1 (Zen 3: 32 KiB), so the choice is not tied to this host's caches (not yet measured on Zen 3). */
#define PK_PREFETCH_TILES 4

/* packed_grouped_wide.c: Q5_0, Q4_K, Q5_K, Q6_K */
int pkw_is_wide(int fmt);
void pkw_group_rows(const ps_packed_state *st, uint8_t *dst);
void pkw_grouped_row_run(const ps_packed_state *st, int64_t row, int64_t run, uint8_t *u, float *d, float *m);
int pkw_grouped_linear(const ps_packed_state *st, const float *x, int64_t rows, float *y, int threads);
const char *pkw_grouped_isa(void);
/* packed_grouped_panel.c: from PKP_MIN_ROWS activation rows on, every format in the 8-lane builds, Q5_0 and the K
 * formats in the 16-lane one (the same bits) */
#define PKP_MIN_ROWS 8
int pkp_panel_linear(const ps_packed_state *st, const float *x, int64_t rows, float *y, int threads);

static inline int64_t pk_tile_header(int fmt) { return fmt == PK_Q4_1 ? 64 : 32; }
static inline int64_t pk_tile_bytes(int fmt) { return PK_GROUP_ROWS * PK_BLOCK_BYTES[fmt]; }

/* Row r's 32 codes in a tile, in input order. */
static inline void pk_grouped_codes(const uint8_t *tile, int fmt, int r, uint8_t *u) {
    if (fmt == PK_Q8_0) {  /* the unsigned code q + 128, as pk_codes_scalar gives it */
        for (int k = 0; k < 32; k++) u[k] = tile[32 + 16 * k + r] ^ 0x80;
        return;
    }
    pk_tile4_codes(tile + pk_tile_header(fmt), r, u);
}

/* Row r's scale and offset in a tile (w = d u + m, as gguf's dequantizer). */
static inline void pk_grouped_scales(const uint8_t *tile, int fmt, int r, float *d, float *m) {
    *d = pk_half(tile + 2 * r);
    *m = fmt == PK_Q4_1 ? pk_half(tile + 32 + 2 * r) : (fmt == PK_Q8_0 ? -128.0f : -8.0f) * *d;
}

/* Rewrites a file-layout matrix (`st`, row_group 0) into the grouped layout at dst (row_bytes * out_features
 * bytes, not overlapping st->data). Returns nonzero when the matrix cannot be grouped. */
PK_EXPORT int pagedserve_packed_group_rows(const ps_packed_state *st, uint8_t *dst) {
    if (pk_check(st) || st->row_group != 0 || !pk_groupable(st->format) || st->out_features % PK_GROUP_ROWS)
        return 1;
    const int fmt = st->format;
    if (pkw_is_wide(fmt)) {
        pkw_group_rows(st, dst);
        return 0;
    }
    const int64_t nb = st->in_features / 32, bb = PK_BLOCK_BYTES[fmt], hb = pk_tile_header(fmt);
    for (int64_t g = 0; g < st->out_features / PK_GROUP_ROWS; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *tile = dst + (g * nb + b) * pk_tile_bytes(fmt);
            memset(tile + hb, 0, (size_t)(pk_tile_bytes(fmt) - hb));
            for (int r = 0; r < PK_GROUP_ROWS; r++) {
                const uint8_t *blk = st->data + (g * PK_GROUP_ROWS + r) * st->row_bytes + b * bb;
                uint8_t u[32];
                pk_codes_scalar(fmt, blk, 0, u);
                memcpy(tile + 2 * r, blk, 2);
                if (fmt == PK_Q8_0) {
                    for (int k = 0; k < 32; k++) tile[32 + 16 * k + r] = blk[2 + k];
                    continue;
                }
                if (fmt == PK_Q4_1) memcpy(tile + 32 + 2 * r, blk + 2, 2);
                for (int k = 0; k < 32; k++) {
                    uint32_t word;
                    uint8_t *at = tile + hb + 64 * (k / 8) + 4 * r;
                    memcpy(&word, at, 4);
                    word |= (uint32_t)u[k] << (4 * (k % 8));
                    memcpy(at, &word, 4);
                }
            }
        }
    }
    return 0;
}

/* Run b (of in / 32) of row `row` of the grouped matrix: codes and d, m per 16-value half for
 * packed_dequantize.c. */
void pk_grouped_row_run(const ps_packed_state *st, int64_t row, int64_t b, uint8_t *u, float *d, float *m) {
    const int fmt = st->format;
    if (pkw_is_wide(fmt)) {
        pkw_grouped_row_run(st, row, b, u, d, m);
        return;
    }
    const int64_t nb = st->in_features / 32, g = row / PK_GROUP_ROWS;
    const uint8_t *tile = st->data + (g * nb + b) * pk_tile_bytes(fmt);
    pk_grouped_codes(tile, fmt, (int)(row % PK_GROUP_ROWS), u);
    pk_grouped_scales(tile, fmt, (int)(row % PK_GROUP_ROWS), d, m);
    d[1] = d[0], m[1] = m[0];
}

#if defined(PS_AVX512_VNNI)
#define PK_GROUPED_ISA "avx512_vnni"
/* y[r][16 rows of group] for R activation rows from their int16 blocks: per block the integer dots (act_q16.h),
 * then tot += (d da) * dot + m * sum(x), the same instructions per row whatever R. */
PK_INLINE void pk_grouped_rows(int fmt, const uint8_t *tiles, int64_t nb, const float *x, int64_t in, pq_act act,
                               int R, const float *bias, float *y, int64_t out) {
    (void)x, (void)in;
    const int64_t hb = pk_tile_header(fmt), tb = pk_tile_bytes(fmt);
    __m512 tot[PK_GROUP_TILE];
    for (int r = 0; r < R; r++) tot[r] = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tile = tiles + b * tb;
        for (int64_t l = 0; l <= tb; l += 64) _mm_prefetch((const char *)tile + PK_PREFETCH_TILES * tb + l, _MM_HINT_T0);
        __m512i acc[2 * PK_GROUP_TILE];
        if (fmt == PK_Q8_0) pq_dots8(tile + hb, 1, act.q + 32 * b, 32 * nb, R, acc);  /* signed codes: m = 0 */
        else pq_dots4(tile + hb, act.q + 32 * b, 32 * nb, R, acc);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tile));
        const __m512 m = fmt == PK_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 32)))
                                        : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        for (int r = 0; r < R; r++)
            tot[r] = pq_block_total(tot[r], acc[r], d, m, act.da[r * nb + b], act.sx[r * nb + b], fmt != PK_Q8_0);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * out, tot[r]);
}
#elif defined(PQ_LANES8)
#define PK_GROUPED_ISA PQ_INT16
/* The avx512_vnni kernel in two 8-lane halves: rows 0-7 (tot[2r]) and 8-15 (tot[2r + 1]) of the group. */
PK_INLINE void pk_grouped_rows(int fmt, const uint8_t *tiles, int64_t nb, const float *x, int64_t in, pq_act act,
                               int R, const float *bias, float *y, int64_t out) {
    (void)x, (void)in;
    const int64_t hb = pk_tile_header(fmt), tb = pk_tile_bytes(fmt);
    __m256 tot[2 * PK_GROUP_TILE];
    for (int r = 0; r < R; r++) {
        tot[2 * r] = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        tot[2 * r + 1] = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *tile = tiles + b * tb;
        for (int64_t l = 0; l <= tb; l += 64) _mm_prefetch((const char *)tile + PK_PREFETCH_TILES * tb + l, _MM_HINT_T0);
        __m256i acc[4 * PK_GROUP_TILE];
        if (fmt == PK_Q8_0) pq_dots8(tile + hb, 1, act.q + 32 * b, 32 * nb, R, acc);  /* signed codes: m = 0 */
        else pq_dots4(tile + hb, act.q + 32 * b, 32 * nb, R, acc);
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tile));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 16)));
        const __m256 m0 = fmt == PK_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 32)))
                                         : _mm256_mul_ps(d0, _mm256_set1_ps(-8.0f));
        const __m256 m1 = fmt == PK_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 48)))
                                         : _mm256_mul_ps(d1, _mm256_set1_ps(-8.0f));
        for (int r = 0; r < R; r++) {
            const float da = act.da[r * nb + b], sx = act.sx[r * nb + b];
            tot[2 * r] = pq_block_total8(tot[2 * r], acc[2 * r], d0, m0, da, sx, fmt != PK_Q8_0);
            tot[2 * r + 1] = pq_block_total8(tot[2 * r + 1], acc[2 * r + 1], d1, m1, da, sx, fmt != PK_Q8_0);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(y + r * out, tot[2 * r]);
        _mm256_storeu_ps(y + r * out + 8, tot[2 * r + 1]);
    }
}
#else
#define PK_GROUPED_ISA "portable"
PK_INLINE void pk_grouped_rows(int fmt, const uint8_t *tiles, int64_t nb, const float *x, int64_t in, pq_act act,
                               int R, const float *bias, float *y, int64_t out) {
    const float *sx = act.sx;
    for (int r = 0; r < R; r++) {
        for (int row = 0; row < PK_GROUP_ROWS; row++) {
            float total = bias ? bias[row] : 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *tile = tiles + b * pk_tile_bytes(fmt);
                uint8_t u[32];
                float d, m, acc = 0.0f;
                pk_grouped_codes(tile, fmt, row, u);
                pk_grouped_scales(tile, fmt, row, &d, &m);
                for (int k = 0; k < 32; k++) acc += (float)u[k] * x[r * in + 32 * b + k];
                total += d * acc + m * sx[r * nb + b];
            }
            y[r * out + row] = total;
        }
    }
}
#endif

#define PK_GROUPED_CASE(F, N) \
    case N: pk_grouped_rows(F, tiles, nb, x, in, act, N < PK_GROUP_TILE ? N : PK_GROUP_TILE, bias, y, out); return;
/* R a constant in each instance; R never exceeds PK_GROUP_TILE (pk_grouped_linear tiles the rows by it) */
#define PK_GROUPED_CASES(F)                                                                     \
    switch (R) {                                                                                \
    PK_GROUPED_CASE(F, 1) PK_GROUPED_CASE(F, 2) PK_GROUPED_CASE(F, 3) PK_GROUPED_CASE(F, 4)     \
    PK_GROUPED_CASE(F, 5) PK_GROUPED_CASE(F, 6) PK_GROUPED_CASE(F, 7)                           \
    default: pk_grouped_rows(F, tiles, nb, x, in, act, PK_GROUP_TILE, bias, y, out); return;    \
    }

static void pk_grouped_any(int fmt, const uint8_t *tiles, int64_t nb, const float *x, int64_t in, pq_act act,
                           int R, const float *bias, float *y, int64_t out) {
    if (fmt == PK_Q4_1) PK_GROUPED_CASES(PK_Q4_1)
    if (fmt == PK_Q8_0) PK_GROUPED_CASES(PK_Q8_0)
    PK_GROUPED_CASES(PK_Q4_0)
}

/* y = x @ W^T (+ bias) for a grouped matrix: the activations' block sums (and int16 blocks) once, then the groups
 * work-shared over the threads. Returns 0, or 2 when out of memory. */
int pk_grouped_linear(const ps_packed_state *st, const float *x, int64_t rows, float *y, int threads) {
#if defined(PQ_LANES8)
    if (rows >= PKP_MIN_ROWS) return pkp_panel_linear(st, x, rows, y, threads);
#elif defined(PS_AVX512_VNNI)
    /* 16 lanes: the 4/8-bit tiles' own kernel below (8 rows per pass, one and per code pair) ran ~1.2-1.35x the
     * panel's speed at 8 to 64 rows (Q4_0, Q4_1, Q8_0 on 1B and SmolLM2 shapes, noisy); the wide formats' 4-row
     * kernel ran at half the panel's for Q6_K and level for Q4_K */
    if (rows >= PKP_MIN_ROWS && pkw_is_wide(st->format)) return pkp_panel_linear(st, x, rows, y, threads);
#endif
    if (pkw_is_wide(st->format)) return pkw_grouped_linear(st, x, rows, y, threads);
    const int64_t in = st->in_features, out = st->out_features, nb = in / 32, groups = out / PK_GROUP_ROWS;
    const int64_t group_bytes = nb * pk_tile_bytes(st->format);
    pq_act act;
    if (pq_alloc(&act, rows, nb)) return 2;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) pq_quantize(x, nb, r, r + 1, st->format != PK_Q8_0, &act);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            for (int64_t r0 = 0; r0 < rows; r0 += PK_GROUP_TILE) {
                const int R = rows - r0 < PK_GROUP_TILE ? (int)(rows - r0) : PK_GROUP_TILE;
                pk_grouped_any(st->format, st->data + g * group_bytes, nb, x + r0 * in, in, pq_rows(&act, r0, nb),
                               R, st->bias ? st->bias + g * PK_GROUP_ROWS : NULL, y + r0 * out + g * PK_GROUP_ROWS, out);
            }
        }
    }
    pq_free(&act);
    return 0;
}

PK_EXPORT const char *pagedserve_packed_grouped_isa(void) { return PK_GROUPED_ISA; }

/* The build of format fmt's (PK_*) interleaved-rows kernel; NULL for an unknown format. */
PK_EXPORT const char *pagedserve_packed_grouped_isa_of(int fmt) {
    if (fmt < 0 || fmt >= PK_NUM_FORMATS) return NULL;
    return pkw_is_wide(fmt) ? pkw_grouped_isa() : PK_GROUPED_ISA;
}
