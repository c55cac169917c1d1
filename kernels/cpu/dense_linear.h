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

#endif
