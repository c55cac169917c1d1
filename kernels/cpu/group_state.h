/* One GPTQ/AWQ matrix as the native group kernels read it (group_linear.c: one output row after another;
 * group_grouped.c: output rows interleaved in groups of GQ_ROWS). Mirrored by GroupState in
 * kernels/cpu/group_packed.py. */
#ifndef PAGEDSERVE_CPU_GROUP_STATE_H
#define PAGEDSERVE_CPU_GROUP_STATE_H

#include <stdint.h>

#include "packed_blocks.h"

#define GQ_ROWS PK_GROUP_ROWS  /* output rows per group of the interleaved layout, as the GGUF one's */

typedef struct {
    int32_t bits;         /* 4 or 8 */
    int32_t num_threads;  /* for calls through ps_linear_fn; 0: omp_get_max_threads() */
    int64_t in_features, out_features, groups;
    const uint8_t *codes;
    const void *scales;   /* [out, groups]; grouped: [out / GQ_ROWS, groups, GQ_ROWS] */
    int32_t scale_f16;    /* scales are fp16 bits (else fp32) */
    int32_t row_group;    /* 0: rows one after another; GQ_ROWS: interleaved (group_grouped.c) */
    const uint8_t *zeros;        /* laid out as scales */
    const int32_t *run_group;    /* [in / 32] */
    const int32_t *perm;         /* [in]: x column of sorted input k, or NULL */
    const float *bias;           /* [out] or NULL */
} ps_group_state;

static inline int gq_check(const ps_group_state *st) {
    if (st == NULL || (st->bits != 4 && st->bits != 8) || st->in_features <= 0 || st->in_features % 32) return 1;
    if (st->row_group != 0 && (st->row_group != GQ_ROWS || st->out_features % GQ_ROWS)) return 1;
    return st->out_features <= 0 || st->groups <= 0 || st->codes == NULL || st->scales == NULL || st->zeros == NULL;
}

/* Index of (output row o, quant group g) in scales and zeros. */
static inline int64_t gq_sz_index(const ps_group_state *st, int64_t o, int64_t g) {
    if (st->row_group == 0) return o * st->groups + g;
    return ((o / GQ_ROWS) * st->groups + g) * GQ_ROWS + o % GQ_ROWS;
}

static inline float gq_scale(const ps_group_state *st, int64_t i) {
    return st->scale_f16 ? pk_half((const uint8_t *)st->scales + 2 * i) : ((const float *)st->scales)[i];
}

/* group_grouped.c */
void gq_grouped_codes(const ps_group_state *st, int64_t o, int64_t j, uint8_t *u);
int gq_grouped_product(const ps_group_state *st, const float *x, int64_t rows, float *y, int threads);

#endif
