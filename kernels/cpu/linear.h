/* The C contract of one linear layer for pagedserve's native small-batch path: y[rows, out] = x[rows, in] @ W^T
 * (+ bias), with x and y fp32, row-major and contiguous. Each weight format (dense bf16/fp32, GGUF blocks, GPTQ/AWQ
 * groups) provides a function of this type and an opaque state it reads; a fused layer loop calls it without knowing
 * the format. The function parallelizes internally (OpenMP on torch's pool) and returns 0, or nonzero on bad args. */
#ifndef PAGEDSERVE_CPU_LINEAR_H
#define PAGEDSERVE_CPU_LINEAR_H

#include <stdint.h>

typedef int (*ps_linear_fn)(const void *state, const float *x, int64_t rows, float *y);

typedef struct {
    ps_linear_fn fn;
    const void *state;
    int64_t in_features, out_features;
} ps_linear;

static inline int ps_linear_apply(const ps_linear *linear, const float *x, int64_t rows, float *y) {
    return linear->fn(linear->state, x, rows, y);
}

#endif
