/* The interleaved-rows layout (ps_packed_state.row_group, packed_grouped.c) of Q5_0, Q4_K, Q5_K and Q6_K: codes
 * wider than 4 bits or scales per 32-value run of a 256-value super-block, which the 4/8-bit tiles cannot hold.
 *
 * Why: in the file's layout every 32 weights of one row need their scales decoded and broadcast and their codes
 * gathered lane by lane (pk_codes_avx2), so on an AVX2 host (Zen 3: no AVX-512) a Q4_K_M model's linears ran
 * bound by instructions, not by reading the weights. With 16 rows side by side, one 8-lane vector holds one input
 * pair of 8 rows and a run's scales are decoded once per group as vectors.
 *
 * Builds (isa.h, act_q16.h): every one with int16 activations (all with AVX2: PQ_INT16) takes the
 * same integer pair dots (vpmaddwd + vpaddd on plain AVX2, vpdpwssd with AVX-VNNI or AVX512-VNNI) and one float
 * epilogue per run, in two 8-row halves (avx2, avx2_vnni, avx512: packed_grouped_wide8.h) or one 16-lane register
 * (avx512_vnni: packed_grouped_wide16.h), so their results are equal bit for bit. The portable build runs C loops
 * on fp32 activations; loaders keep the file's layout there (packed.py's grouped_isa).
 * Per run every build adds (d da) dot(u, q) + m sx with the exact fp32 block sum sx (Q6_K: signed codes u - 32,
 * one scale per 16-value half, no offset term, the centring taken from the activations' integer half sums:
 * pkw_centring); act_q16.h states the int16 rounding's bound. (int8 activations with u8 x s8 byte dots, as
 * llama.cpp's Q8, ran these kernels 1.5-2.5x faster per core but agreed with the dequantized Gemma 3 270M Q4_K_M
 * on 91% of teacher-forced top-1 tokens, against 100% with int16.)
 *
 * Layout, same bytes as the file's, group g = rows 16g..16g+15 stored in place of those rows. Per storage block
 * (32 inputs for Q5_0, 256 for the K formats) one tile: a header, then per 32-input run j a 4-bit plane (4 chunks
 * of 64 bytes, chunk c's 32-bit word r = row r's low nibbles of inputs 8c..8c+7, input 8c+p in bits 4p..4p+3: the
 * Q4_0 tile's) and for 5-bit codes (Q5_0, Q5_K) a plane of high bits: 16 words, word r bit 4c + p = bit 4 of input
 * 8c + p, bit 16 + 4c + p that of 8c + p + 4. Shifted by a constant and masked, a high word thus lines up with the
 * 4-bit word's (w >> 4p) & 0x000F000F, which holds inputs 8c + p and 8c + p + 4 as two int16: the order act_q16.h's
 * pq_quantize stores activations in. Q6_K's run is 6 planes of whole 6-bit codes in that order instead
 * (packed_wide_layout.h's pkw_q6_put), as the shifted high plane cost ~2x Q4_K's instructions per byte.
 * Headers: Q5_0: the 16 rows' d (fp16, 32 bytes). Q4_K/Q5_K: d (32), dmin (32), then per run j 16 bytes
 * sc | (mn >> 4) << 6 and per run pair 16 bytes mn & 15 (run 2i + 1 in the high nibble): 6-bit scale and min.
 * Q6_K: d (32), then per 16-value half h (0..15) the 16 rows' int8 scales. */
#include "isa.h"
#include <omp.h>

#include "act_q16_dots.h"
#include "packed_wide_layout.h"

#define PKW_TILE 4          /* activation rows per pass over a group's weights */
/* Software prefetch distance, bytes: on one SPR core (1B Q4_K_M, AVX2) 1.5 KiB ran as 2, 2.5-4 KiB 5-15% slower,
 * the L2 hint the same, the NTA hint and no prefetch 25-35% slower. ~1 tile of Q4_K (2304 bytes), inside any L1. */
#define PKW_PREFETCH 2048

int pkw_is_wide(int fmt) { return fmt == PK_Q5_0 || fmt == PK_Q4_K || fmt == PK_Q5_K || fmt == PK_Q6_K; }

static inline void pkw_or32(uint8_t *at, uint32_t bits) {
    uint32_t word;
    memcpy(&word, at, 4);
    word |= bits;
    memcpy(at, &word, 4);
}

/* One row's storage block `blk` into its place r of `tile`. */
static void pkw_put_row(int fmt, const uint8_t *blk, int r, uint8_t *tile) {
    if (fmt == PK_Q6_K) {
        memcpy(tile + 2 * r, blk + 208, 2);
        for (int h = 0; h < 16; h++) tile[32 + 16 * h + r] = blk[192 + h];
    } else {
        memcpy(tile + 2 * r, blk, 2);
    }
    if (fmt == PK_Q4_K || fmt == PK_Q5_K) {
        memcpy(tile + 32 + 2 * r, blk + 2, 2);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            pk_scale_min_k4(blk + 4, j, &sc, &mn);
            tile[64 + 16 * j + r] = (uint8_t)(sc | (mn >> 4) << 6);
            tile[192 + 16 * (j / 2) + r] |= (uint8_t)((mn & 15) << 4 * (j & 1));
        }
    }
    for (int j = 0; j < pkw_runs(fmt); j++) {
        uint8_t u[32];
        uint8_t *run = tile + pkw_header(fmt) + j * pkw_run_bytes(fmt);
        pk_codes_scalar(fmt, blk, j, u);
        for (int k = 0; k < 32; k++) {
            const int c = k / 8, p = k % 4, h = k % 8 / 4;
            if (fmt == PK_Q6_K) {
                pkw_q6_put(run, r, k, u[k]);
                continue;
            }
            pkw_or32(run + 64 * c + 4 * r, (uint32_t)(u[k] & 15) << 4 * (k % 8));
            if (fmt != PK_Q4_K) pkw_or32(run + 256 + 4 * r, (uint32_t)(u[k] >> 4) << (16 * h + 4 * c + p));
        }
    }
}

/* packed_grouped.c's pagedserve_packed_group_rows for these formats (checked there). */
void pkw_group_rows(const ps_packed_state *st, uint8_t *dst) {
    const int fmt = st->format;
    const int64_t nb = st->in_features / PK_BLOCK_VALUES[fmt], tb = pkw_tile_bytes(fmt);
    for (int64_t g = 0; g < st->out_features / PK_GROUP_ROWS; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *tile = dst + (g * nb + b) * tb;
            memset(tile, 0, (size_t)tb);
            for (int r = 0; r < PK_GROUP_ROWS; r++)
                pkw_put_row(fmt, st->data + (g * PK_GROUP_ROWS + r) * st->row_bytes + b * PK_BLOCK_BYTES[fmt], r,
                            tile);
        }
    }
}

/* Row r's codes (0..31, Q6_K 0..63) and scales of run j of a tile: w = d u + m per 16-value half. */
static void pkw_row_run(int fmt, const uint8_t *tile, int r, int j, uint8_t *u, float *d, float *m) {
    const uint8_t *run = tile + pkw_header(fmt) + j * pkw_run_bytes(fmt);
    if (fmt != PK_Q6_K) pk_tile4_codes(run, r, u);
    for (int k = 0; k < 32; k++) {
        const int c = k / 8, p = k % 4, h = k % 8 / 4;
        uint32_t word;
        if (fmt == PK_Q6_K) {
            u[k] = (uint8_t)pkw_q6_get(run, r, k);
        } else if (fmt != PK_Q4_K) {
            memcpy(&word, run + 256 + 4 * r, 4);
            u[k] |= (uint8_t)(((word >> (16 * h + 4 * c + p)) & 1) << 4);
        }
    }
    const float dr = pk_half(tile + 2 * r);
    if (fmt == PK_Q5_0) {
        d[0] = d[1] = dr, m[0] = m[1] = -16.0f * dr;
    } else if (fmt == PK_Q6_K) {
        for (int h = 0; h < 2; h++) d[h] = dr * (float)(int8_t)tile[32 + 16 * (2 * j + h) + r], m[h] = -32.0f * d[h];
    } else {
        const uint8_t a = tile[64 + 16 * j + r], lo = (tile[192 + 16 * (j / 2) + r] >> 4 * (j & 1)) & 15;
        d[0] = d[1] = dr * (float)(a & 63);
        m[0] = m[1] = -pk_half(tile + 32 + 2 * r) * (float)(lo | (a >> 6) << 4);
    }
}

/* packed_grouped.c's pk_grouped_row_run: run `run` (of in / 32) of row `row`. */
void pkw_grouped_row_run(const ps_packed_state *st, int64_t row, int64_t run, uint8_t *u, float *d, float *m) {
    const int fmt = st->format, runs = pkw_runs(fmt);
    const int64_t nb = st->in_features / PK_BLOCK_VALUES[fmt], g = row / PK_GROUP_ROWS;
    const uint8_t *tile = st->data + (g * nb + run / runs) * pkw_tile_bytes(fmt);
    pkw_row_run(fmt, tile, (int)(row % PK_GROUP_ROWS), (int)(run % runs), u, d, m);
}

#if defined(PQ_INT16)
#define PKW_ISA PQ_INT16

/* Each run's Q6_K codes are centred (u - 32) in the integer dot: dot(u - 32, q) = dot(u, q) - 32 sum(q) over each
 * 16-input half, exact in int32, so the centring is where each half's dot starts, made once per call, instead of
 * a subtraction per code vector. sq[2 k + h] = -32 x the sum of run k's int16 activations of half h. */
static void pkw_centring(const int16_t *q, int64_t nruns, int32_t *sq) {
    for (int64_t i = 0; i < 2 * nruns; i++) {
        int32_t sum = 0;
        for (int l = 0; l < 16; l++) sum += q[16 * i + l];  /* the 4-bit order permutes within 8 inputs only */
        sq[i] = -32 * sum;
    }
}

#if defined(PS_AVX512_VNNI)
#include "packed_grouped_wide16.h"
#else
#include "packed_grouped_wide8.h"
#endif
#else
#define PKW_ISA "portable"
/* C loops on fp32 activations: per run d sum(u x) + m sx (Q6_K: per half, centred codes). */
PKW_INLINE void pkw_rows(int fmt, const uint8_t *tiles, int64_t nb, const float *x, int64_t in, pq_act act,
                         const int32_t *sq, int R, const float *bias, float *y, int64_t out) {
    (void)sq;
    const int64_t nruns = nb * pkw_runs(fmt);
    for (int r = 0; r < R; r++) {
        for (int row = 0; row < PK_GROUP_ROWS; row++) {
            float total = bias ? bias[row] : 0.0f;
            for (int64_t k = 0; k < nruns; k++) {
                const uint8_t *tile = tiles + k / pkw_runs(fmt) * pkw_tile_bytes(fmt);
                const float *xk = x + r * in + 32 * k;
                uint8_t u[32];
                float d[2], m[2], acc[2] = {0.0f, 0.0f};
                pkw_row_run(fmt, tile, row, (int)(k % pkw_runs(fmt)), u, d, m);
                const int centre = fmt == PK_Q6_K ? 32 : 0;
                for (int l = 0; l < 32; l++) acc[l / 16] += (float)(u[l] - centre) * xk[l];
                if (fmt == PK_Q6_K) total += d[0] * acc[0] + d[1] * acc[1];
                else total += d[0] * (acc[0] + acc[1]) + m[0] * act.sx[r * nruns + k];
            }
            y[r * out + row] = total;
        }
    }
}
#endif

#define PKW_CASE(F, N) case N: pkw_rows(F, tiles, nb, x, in, act, sq, N, bias, y, out); return;
#define PKW_CASES(F) switch (R) { PKW_CASE(F, 1) PKW_CASE(F, 2) PKW_CASE(F, 3) default: PKW_CASE(F, PKW_TILE) }

static void pkw_any(int fmt, const uint8_t *tiles, int64_t nb, const float *x, int64_t in, pq_act act,
                    const int32_t *sq, int R, const float *bias, float *y, int64_t out) {
    switch (fmt) {
    case PK_Q5_0: PKW_CASES(PK_Q5_0)
    case PK_Q4_K: PKW_CASES(PK_Q4_K)
    case PK_Q5_K: PKW_CASES(PK_Q5_K)
    default: PKW_CASES(PK_Q6_K)
    }
}

/* packed_grouped.c's pk_grouped_linear for these formats: activations rounded once (int16 per 32 inputs, 4-bit
 * order), then the groups work-shared over the threads. Returns 0, or 2 when out of memory. */
int pkw_grouped_linear(const ps_packed_state *st, const float *x, int64_t rows, float *y, int threads) {
    const int fmt = st->format;
    const int64_t in = st->in_features, out = st->out_features, nruns = in / 32, groups = out / PK_GROUP_ROWS;
    const int64_t nb = in / PK_BLOCK_VALUES[fmt], group_bytes = nb * pkw_tile_bytes(fmt);
    pq_act act;
    if (pq_alloc(&act, rows, nruns)) return 2;
    int32_t *sq = NULL;  /* Q6_K's centring (pkw_centring) */
#if defined(PQ_INT16)
    if (fmt == PK_Q6_K && (sq = malloc(sizeof(int32_t) * 2 * (size_t)(rows * nruns))) == NULL) {
        pq_free(&act);
        return 2;
    }
#endif
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            pq_quantize(x, nruns, r, r + 1, 1, &act);
#if defined(PQ_INT16)
            if (sq) pkw_centring(act.q + 32 * r * nruns, nruns, sq + 2 * r * nruns);
#endif
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            for (int64_t r0 = 0; r0 < rows; r0 += PKW_TILE) {
                const int R = rows - r0 < PKW_TILE ? (int)(rows - r0) : PKW_TILE;
                pkw_any(fmt, st->data + g * group_bytes, nb, x + r0 * in, in, pq_rows(&act, r0, nruns),
                        sq ? sq + 2 * r0 * nruns : NULL, R, st->bias ? st->bias + g * PK_GROUP_ROWS : NULL, y + r0 * out + g * PK_GROUP_ROWS, out);
            }
        }
    }
    free(sq);
    pq_free(&act);
    return 0;
}

const char *pkw_grouped_isa(void) { return PKW_ISA; }
