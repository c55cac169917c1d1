/* The LoRA delta of one linear layer for a step's adapters (engine/lora/layers.py, bound in kernels/cpu_lora.py):
 * for each adapter's span of rows, out[r] += (x[r] A^T) B^T, in fp32 whatever the activations' dtype, the sum
 * rounded once into out as torch's `out += delta` rounds it.
 *
 * Why: per layer and adapter, torch needs a shrink, an expand and an add, each a call with a fixed cost that
 * dominates at decode sizes (rank-wide matrices, a dozen rows): one call per layer for all the step's adapters
 * instead. Rows are independent: OpenMP splits them across the threads the caller asks for.
 */
#include "cpu_native.h"

/* One adapter on one layer: A [rank, in] and B^T [rank, out], fp32, contiguous; rank 0: the adapter skips it. */
typedef struct {
    int64_t rank;
    const float *a;
    const float *b;
} LoraRef;

INLINE void lora_row(const void *x, void *out, const LoraRef *ref, int64_t in, int64_t n_out, const int dt) {
    const int64_t cin = in / 16, cout = n_out / 16, rank = ref->rank;
    f32x16 row[cin];
    float shrunk[rank];
    for (int64_t c = 0; c < cin; c++) row[c] = load16(x, c, dt);
    for (int64_t k = 0; k < rank; k++) {
        const float *a = ref->a + k * in;
        f32x16 even = {0}, odd = {0};
        for (int64_t c = 0; c < cin; c++) {
            f32x16 w;
            memcpy(&w, a + 16 * c, sizeof w);
            if (c & 1) odd += row[c] * w;
            else even += row[c] * w;
        }
        shrunk[k] = hsum16(even + odd);
    }
    for (int64_t c = 0; c < cout; c++) {
        f32x16 delta = {0};
        for (int64_t k = 0; k < rank; k++) {
            f32x16 w;
            memcpy(&w, ref->b + k * n_out + 16 * c, sizeof w);
            delta += shrunk[k] * w;
        }
        store16(out, c, dt, load16(out, c, dt) + delta);
    }
}

/* spans [groups, 2]: each adapter's rows [start, end); refs [groups]: its matrices for this layer. x [rows, in]
 * and out [rows, n_out] of dtype dt with row strides in elements. in and n_out must be multiples of 16. */
int pagedserve_lora_delta(const void *x, int64_t x_stride, void *out, int64_t out_stride, int dt, int64_t in,
                          int64_t n_out, int64_t groups, const int64_t *spans, const LoraRef *refs, int num_threads) {
    if (in % 16 || n_out % 16 || (dt != DT_F32 && dt != DT_BF16 && dt != DT_F16)) return -1;
    int64_t total = 0;
    for (int64_t g = 0; g < groups; g++) total += spans[2 * g + 1] - spans[2 * g];
    const int64_t size = elem_size(dt);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < total; i++) {
        int64_t g = 0, r = i;
        while (r >= spans[2 * g + 1] - spans[2 * g]) {
            r -= spans[2 * g + 1] - spans[2 * g];
            g++;
        }
        const LoraRef *ref = &refs[g];
        if (ref->rank == 0) continue;
        const int64_t index = spans[2 * g] + r;
        const char *xr = (const char *)x + index * x_stride * size;
        char *outr = (char *)out + index * out_stride * size;
        if (dt == DT_F32) lora_row(xr, outr, ref, in, n_out, DT_F32);
        else if (dt == DT_BF16) lora_row(xr, outr, ref, in, n_out, DT_BF16);
        else lora_row(xr, outr, ref, in, n_out, DT_F16);
    }
    return 0;
}
