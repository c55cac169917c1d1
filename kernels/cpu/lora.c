/* The LoRA delta of one linear layer for a step's adapters (engine/lora/layers.py, bound in kernels/cpu/lora.py):
 * for each adapter's span of rows, out[r] += (x[r] A^T) B^T, in fp32 whatever the activations' dtype, the sum
 * rounded once into out as torch's `out += delta` rounds it.
 *
 * Why: per layer and adapter, torch needs a shrink, an expand and an add, each a call with a fixed cost that
 * dominates at decode sizes (rank-wide matrices, a dozen rows): one call per layer for all the step's adapters
 * instead. Tiles of rows are independent: OpenMP splits them across the threads the caller asks for.
 */
#include "isa.h"
#include "native.h"

/* One adapter on one layer: A [rank, in] and B^T [rank, out], fp32, contiguous; rank 0: the adapter skips it.
 * B^T of a fused layer is block-diagonal (q/k/v or gate/up each with its own A rows): `parts` lists the blocks as
 * (first rank row, end, first output column, end; columns multiples of 16), so the expand skips the zeros. */
#define MAX_PARTS 3
typedef struct {
    int64_t rank;
    const float *a;
    const float *b;
    int64_t num_parts;
    int64_t parts[MAX_PARTS][4];
} LoraRef;

/* Rows are taken TILE at a time (one adapter's): each weight vector loaded once serves them all, so A and B stream
 * from cache once per tile instead of once per row (the kernel was bound by those reads). */
#define TILE 8
#define MAX_IN 8192  /* a tile of fp32 rows lives on the thread's stack: 256 KiB at most */

INLINE void lora_tile(const char *x, int64_t x_row, char *out, int64_t out_row, int64_t n, const LoraRef *ref,
                      int64_t in, int64_t n_out, const int dt) {
    const int64_t cin = in / 16, rank = ref->rank;
    f32x16 rows[TILE][cin];
    float shrunk[rank][TILE];
    for (int64_t t = 0; t < TILE; t++)
        for (int64_t c = 0; c < cin; c++) rows[t][c] = t < n ? load16(x + t * x_row, c, dt) : (f32x16){0};
    for (int64_t k = 0; k < rank; k++) {
        const float *a = ref->a + k * in;
        f32x16 acc[TILE] = {{0}};
        for (int64_t c = 0; c < cin; c++) {
            f32x16 w;
            memcpy(&w, a + 16 * c, sizeof w);
            for (int64_t t = 0; t < TILE; t++) acc[t] += rows[t][c] * w;
        }
        for (int64_t t = 0; t < TILE; t++) shrunk[k][t] = hsum16(acc[t]);
    }
    for (int64_t p = 0; p < ref->num_parts; p++)
    for (int64_t c = ref->parts[p][2] / 16; c < ref->parts[p][3] / 16; c++) {
        f32x16 delta[TILE] = {{0}};
        for (int64_t k = ref->parts[p][0]; k < ref->parts[p][1]; k++) {
            f32x16 w;
            memcpy(&w, ref->b + k * n_out + 16 * c, sizeof w);
            for (int64_t t = 0; t < TILE; t++) delta[t] += shrunk[k][t] * w;
        }
        for (int64_t t = 0; t < n; t++) {
            char *row = out + t * out_row;
            store16(row, c, dt, load16(row, c, dt) + delta[t]);
        }
    }
}

/* spans [groups, 2]: each adapter's rows [start, end); refs [groups]: its matrices for this layer. x [rows, in]
 * and out [rows, n_out] of dtype dt with row strides in elements. in and n_out must be multiples of 16. */
int pagedserve_lora_delta(const void *x, int64_t x_stride, void *out, int64_t out_stride, int dt, int64_t in,
                          int64_t n_out, int64_t groups, const int64_t *spans, const LoraRef *refs, int num_threads) {
    if (in % 16 || n_out % 16 || in > MAX_IN || (dt != DT_F32 && dt != DT_BF16 && dt != DT_F16)) return -1;
    int64_t tiles = 0;
    for (int64_t g = 0; g < groups; g++) tiles += (spans[2 * g + 1] - spans[2 * g] + TILE - 1) / TILE;
    const int64_t size = elem_size(dt);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < tiles; i++) {
        int64_t g = 0, tile = i;
        while (tile >= (spans[2 * g + 1] - spans[2 * g] + TILE - 1) / TILE) {
            tile -= (spans[2 * g + 1] - spans[2 * g] + TILE - 1) / TILE;
            g++;
        }
        const LoraRef *ref = &refs[g];
        if (ref->rank == 0) continue;
        const int64_t first = spans[2 * g] + tile * TILE, n = spans[2 * g + 1] - first < TILE ? spans[2 * g + 1] - first : TILE;
        const char *xr = (const char *)x + first * x_stride * size;
        char *outr = (char *)out + first * out_stride * size;
        const int64_t xs = x_stride * size, os = out_stride * size;
        if (dt == DT_F32) lora_tile(xr, xs, outr, os, n, ref, in, n_out, DT_F32);
        else if (dt == DT_BF16) lora_tile(xr, xs, outr, os, n, ref, in, n_out, DT_BF16);
        else lora_tile(xr, xs, outr, os, n, ref, in, n_out, DT_F16);
    }
    return 0;
}
