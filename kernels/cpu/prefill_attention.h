/* What the two prefill attention kernels share: the argument structure kernels/cpu/structs.py mirrors, the task and
 * the per-thread scratch (prefill_attention.c: the fp32-FMA kernel, the tasks and the entry point;
 * prefill_dpbf16.c: bf16 queries over 16-bit or 8-bit caches with AVX512-BF16; prefill_amx.c: the same on AMX tiles
 * where the OS grants them). */
#ifndef PAGEDSERVE_CPU_PREFILL_ATTENTION_H
#define PAGEDSERVE_CPU_PREFILL_ATTENTION_H

#include "native.h"

typedef struct {
    const void *query; int64_t q_token_stride; void *out; int q_dtype;  /* [T, H, D]; heads contiguous, out dense */
    const void *k_cache; const void *v_cache; int kv_dtype;  /* [Hkv, num_blocks, block_size, D] */
    const float *k_scale; const float *v_scale;         /* [Hkv] */
    const _Float16 *k_row_scale, *v_row_scale;          /* int8: [Hkv, num_blocks, block_size]; else NULL */
    const int32_t *block_tables; int64_t block_table_stride;
    const int32_t *seq_lens; const int64_t *rows; const int32_t *query_lens;  /* per chunk; rows: its first row */
    int64_t num_heads, num_kv_heads, head_dim, num_blocks, block_size;
    float scale;
    int64_t window;                                     /* sliding window; 0: none */
} PrefillArgs;

enum { QT = 16, KT = 16 };  /* query positions per task, keys per tile */

/* Per thread, each buffer sized for QT * group rows (a multiple of 16), head_dim and KT keys; each kernel lays its
 * own data out in them. */
typedef struct { float *q, *k, *v, *p, *m, *l, *correction, *acc; } Tile;

/* The part of a sequence's chunk one task owns: KV head h, query positions [j0, j0 + rows) of chunk s; on AMX
 * tiles, vt: the chunk's V^T for head h, [dim][vt_stride] key pairs (prefill_amx.c), else NULL. */
typedef struct { int64_t s, h, j0, rows; uint32_t *vt; int64_t vt_stride; } Task;

/* bf16 queries against bf16, FP8 or int8 keys (each widens or dequantizes to bf16 as the torch path's gather
 * rounds it) take prefill_dpbf16.c where the build targets AVX512-BF16. */
int pagedserve_prefill_amx(int64_t head_dim);
#if defined(PS_AVX512_BF16)
#define PREFILL_DPBF16(kv_dt, q_dt) ((q_dt) == DT_BF16 && (kv_dt) != DT_F32 && (kv_dt) != DT_F16)
void prefill_task_dpbf16(const PrefillArgs *a, const Task *t, Tile *w);
#else
#define PREFILL_DPBF16(kv_dt, q_dt) 0
#endif
#if defined(PS_AMX)
/* prefill_amx.c: tasks whose vt prefill_values_amx set (it returns the buffer to free; NULL: out of memory). */
uint32_t *prefill_values_amx(const PrefillArgs *a, int64_t num_chunks, Task *tasks, int64_t count, int threads);
void prefill_task_amx(const PrefillArgs *a, const Task *t, Tile *w);
#endif

#endif
