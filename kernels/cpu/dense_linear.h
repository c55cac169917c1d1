/* The state of one dense (unquantized) linear layer of the native small-batch path (dense_linear.c, its
 * grouped-rows kernel dense_grouped.c); built by quant/dense_native.py, whose DenseLinearState mirrors it. */
#ifndef PAGEDSERVE_CPU_DENSE_LINEAR_H
#define PAGEDSERVE_CPU_DENSE_LINEAR_H

#include <stdint.h>

enum { DENSE_GROUP_ROWS = 16 };  /* rows interleaved per group in the grouped layout */

typedef struct {
    const void *weight; const void *bias;  /* [out, in] (row_group 0) or grouped (see dense_grouped.c); [out] */
    int w_dtype, bias_dtype;
    int64_t in_features, out_features;
    int32_t row_group;  /* 0: row-major; DENSE_GROUP_ROWS: the grouped layout */
    int32_t x_fp32;  /* 1: x stays fp32 (16-bit weights held for fp32 compute); 0: x rounded to W's dtype first */
} DenseLinear;

/* y[rows, out] = x @ W^T for a grouped bf16 W (no bias), x rounded to bf16 as the row-major kernel rounds it
 * (unless x_fp32).
 * Returns nonzero when this build has no grouped kernel or the state is not one it reads. */
int ps_dense_grouped(const DenseLinear *s, const float *x, int64_t rows, float *y);

/* The grouped layout at any row count (dense_gemm.c): y[rows, out] = x @ W^T + bias, x and y fp32 or bf16 (DT_*),
 * x rounded to bf16 unless x_fp32. Each output is one fixed-order sum over the inputs, whatever `rows`. */
int pagedserve_dense_gemm(const void *state, const void *x, int x_dtype, int64_t rows, void *y, int y_dtype,
                          int allow_amx);

/* The epilogue every GEMM path shares: rows [r0, r0 + n) of 16 outputs from column col0, `c` row r at c + 16 r
 * (fp32 sums), plus the bias, stored in y's dtype. */
void ps_dense_emit(const DenseLinear *s, const float *c, int64_t r0, int64_t n, int64_t col0, void *y, int y_dtype);

/* dense_amx.c: 1 when this build has AMX code and the OS granted this process the tile state (asked once). */
int ps_amx_ready(void);

#if defined(PS_AMX)
/* An AMX tile configuration (ldtilecfg's 64-byte layout). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* Tiles 0-7 at their largest, 16 rows x 64 bytes: what the GEMM loads; the prefill kernel narrows two before
 * loading it. */
static inline TileConfig ps_amx_full_tiles(void) {
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = 16;
    return config;
}
#endif

/* dense_amx.c: the bf16 GEMM on AMX tiles. xp: x in bf16, packed in 1 KB tiles of 16 rows x 32 inputs (zero
 * beyond x), the tiles of one 16-row block one after another (dense_gemm.c's pack_rows). Returns nonzero without
 * AMX. */
int ps_dense_amx(const DenseLinear *s, const uint32_t *xp, int64_t rows, void *y, int y_dtype);

/* dense_amx.c: the same over bf16 x as it is (row-major [rows, in]), its tiles loaded in place: no packed copy.
 * Returns 1 (nothing done) without AMX, where in % 32 != 0 or where x's row stride would make a tile's rows share
 * an L1 set (in a multiple of 2048): pack it then. */
int ps_dense_amx_rows(const DenseLinear *s, const uint16_t *x, int64_t rows, void *y, int y_dtype);

#endif
