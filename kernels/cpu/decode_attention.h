/* The decode attention kernel's arguments (decode_attention.c), shared with the native decode step
 * (decode_step.c), which calls it once per layer. */
#ifndef PAGEDSERVE_CPU_DECODE_ATTENTION_H
#define PAGEDSERVE_CPU_DECODE_ATTENTION_H

#include "native.h"

typedef struct {
    const void *query; int64_t q_token_stride; void *out; int q_dtype;  /* [T, H, D]; heads contiguous, out dense */
    const void *k_cache; const void *v_cache; int kv_dtype;  /* [Hkv, num_blocks, block_size, D] */
    const float *k_scale; const float *v_scale;         /* [Hkv] */
    const _Float16 *k_row_scale, *v_row_scale;          /* int8: [Hkv, num_blocks, block_size]; else NULL */
    const int32_t *block_tables; int64_t block_table_stride;
    const int32_t *seq_lens; const int64_t *rows;       /* per decode sequence */
    int64_t num_heads, num_kv_heads, head_dim, num_blocks, block_size;
    float scale;
    int64_t window;                                     /* sliding window; 0: none */
} DecodeArgs;

int pagedserve_decode_attention(const DecodeArgs *a, int64_t num_seqs, int64_t max_seq_len, int num_threads);

#endif
