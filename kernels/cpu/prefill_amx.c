/* Prefill attention for bf16 queries on AMX tiles (prefill_attention.c's tasks, where the build has AMX and the OS
 * grants the tile state): 16 query positions times the query heads of one KV head as row lanes (prefill_bf16.h),
 * against 128 keys a step.
 *  - scores S^T = K Q^T: A = 16 K rows x 32 dimensions as they lie in the cache (a bf16 cache's full tiles in place),
 *    B = the queries' dimension pairs over 16 row lanes, C = S^T[key][16 lanes], so that the softmax is lane-wise;
 *  - O^T += V^T P^T: A = V^T, 16 dimensions x 32 keys, B = 16 P pairs x 16 row lanes, C = O^T, four dimension
 *    blocks side by side so that the tile products overlap. V^T (key pairs along a row) is built once per chunk and
 *    KV head (prefill_values_amx) and shared by every task of the chunk: transposed per task and 16-key tile it
 *    cost more than the products.
 * Rows of a step with every key visible skip the mask (only the diagonal steps and a window's edge compute it).
 * Products of bf16 values are exact in fp32: besides P's rounding to bf16, only the summation order differs from
 * the torch path (kernels/torch_attention.py).
 */
#include "prefill_bf16.h"
#include "dense_linear.h"  /* ps_amx_ready, TileConfig */

/* Whether bf16 queries of this head dim take AMX tiles here (the build has them, the OS granted the tile state;
 * accumulate_amx takes 64 dimensions at a time). */
int pagedserve_prefill_amx(int64_t head_dim) {
#if defined(PS_AMX)
    return head_dim % 64 == 0 && ps_amx_ready();
#else
    (void)head_dim;
    return 0;
#endif
}

#if defined(PS_AMX)

enum { KS = 128 };  /* keys a step: the P x V tiles' accumulators are loaded and stored once per 128 keys */

/* Key pairs a row of a chunk's V^T holds: its context, then a step's worth of zeros (a step may start at any
 * multiple of 16 keys and read KS keys). */
static int64_t values_stride(int64_t seq_len) { return (seq_len + 15) / 16 * 8 + KS / 2; }

/* The first key a task's rows may see (window), rounded down to its block: blocks before it may be freed. */
static int64_t first_block_key(const PrefillArgs *a, int64_t s, int64_t j0) {
    const int64_t position = a->seq_lens[s] - a->query_lens[s] + j0;
    const int64_t first = a->window > 0 && position >= a->window ? position - a->window + 1 : 0;
    return first / a->block_size * a->block_size;
}

/* Cache rows of keys [k0, k0 + 16) of chunk s, head h, as bf16 [16][dim]: in place for a bf16 cache's full tile
 * within [lo, end), otherwise into buf with the keys outside it zero (a stale or freed slot may hold NaN). */
INLINE const uint16_t *key_rows(const PrefillArgs *a, int64_t s, int64_t h, int64_t k0, int64_t lo, int64_t end,
                                const char *cache, const _Float16 *scales, const int64_t dim, const int kv_dt,
                                uint16_t *buf) {
    const int64_t bs = a->block_size;
    const int32_t *table = a->block_tables + s * a->block_table_stride;
    if (kv_dt == DT_BF16 && bs % 16 == 0 && k0 >= lo && k0 + 16 <= end)
        return (const uint16_t *)cache + ((h * a->num_blocks + table[k0 / bs]) * bs + k0 % bs) * dim;
    for (int64_t i = 0; i < 16; i++) {
        const int64_t key = k0 + i;
        if (key < lo || key >= end) {  /* the table may not reach this key's block */
            memset(buf + i * dim, 0, sizeof(uint16_t) * (size_t)dim);
            continue;
        }
        const int64_t slot = (h * a->num_blocks + table[key / bs]) * bs + key % bs;
        bf16_row(cache + slot * dim * elem_size(kv_dt), scales ? (float)scales[slot] : 1.0f, dim, kv_dt, buf + i * dim);
    }
    return buf;
}

/* vt[d * stride + i2] = (V[k0 + 2 i2][d], V[k0 + 2 i2 + 1][d]) for the 8 key pairs of a 16-key tile. */
static void values_tile(const PrefillArgs *a, const Task *t, int64_t k0, uint16_t *buf) {
    const int64_t dim = a->head_dim, lo = first_block_key(a, t->s, 0), end = a->seq_lens[t->s];
    const uint16_t *v = key_rows(a, t->s, t->h, k0, lo, end, a->v_cache, a->v_row_scale, dim, a->kv_dtype, buf);
    uint32_t *vt = t->vt + k0 / 2;
    for (int64_t d = 0; d < dim; d++)
        for (int64_t i2 = 0; i2 < 8; i2++)
            vt[d * t->vt_stride + i2] = v[2 * i2 * dim + d] | (uint32_t)v[(2 * i2 + 1) * dim + d] << 16;
}

/* V^T of every chunk and KV head the tasks read, zero where no key is (before the first visible block, past the
 * context), and each task's vt and vt_stride pointing into it. Returns the buffer (NULL: out of memory). */
uint32_t *prefill_values_amx(const PrefillArgs *a, int64_t num_chunks, Task *tasks, int64_t count, int threads) {
    const int64_t dim = a->head_dim, hkv = a->num_kv_heads;
    int64_t offsets[num_chunks + 1];
    offsets[0] = 0;
    for (int64_t s = 0; s < num_chunks; s++) offsets[s + 1] = offsets[s] + values_stride(a->seq_lens[s]) * dim * hkv;
    uint32_t *vt = calloc((size_t)(offsets[num_chunks] ? offsets[num_chunks] : 1), sizeof(uint32_t));
    if (!vt) return NULL;
    for (int64_t i = 0; i < count; i++) {
        Task *t = &tasks[i];
        t->vt_stride = values_stride(a->seq_lens[t->s]);
        t->vt = vt + offsets[t->s] + t->h * t->vt_stride * dim;
    }
    int64_t tiles = 0;  /* (chunk, head, 16-key tile) triples, numbered chunk by chunk */
    for (int64_t s = 0; s < num_chunks; s++) tiles += (a->seq_lens[s] + 15) / 16 * hkv;
#pragma omp parallel num_threads(threads)
    {
        uint16_t buf[16 * dim];
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tiles; i++) {
            int64_t s = 0, j = i;
            while (j >= (a->seq_lens[s] + 15) / 16 * hkv) j -= (a->seq_lens[s++] + 15) / 16 * hkv;
            const int64_t h = j % hkv, k0 = j / hkv * 16;
            if (k0 + 16 <= first_block_key(a, s, 0)) continue;
            const int64_t stride = values_stride(a->seq_lens[s]);
            const Task t = {s, h, 0, 0, vt + offsets[s] + h * stride * dim, stride};
            values_tile(a, &t, k0, buf);
        }
    }
    return vt;
}

#define AMX_SCORES(T) if (nrb > T) { _tile_loadd(4, q + 16 * c * rp + 16 * (b0 + T), rp * 4); _tile_dpbf16ps(T, 3, 4); }
#define AMX_STORE(T) if (nrb > T) _tile_stored(T, s + 16 * (b0 + T), rp * 4)

/* S^T of 16 keys, s[key * rp + lane], up to 3 row blocks per pass (tiles 0-2; K in 3, Q in 4). */
static void scores_amx(const uint16_t *k, const uint32_t *q, float *s, const int64_t rp, const int64_t dim) {
    for (int64_t b0 = 0; b0 < rp / 16; b0 += 3) {
        const int64_t nrb = rp / 16 - b0 < 3 ? rp / 16 - b0 : 3;
        _tile_zero(0); _tile_zero(1); _tile_zero(2);
        for (int64_t c = 0; c < dim / 32; c++) {
            _tile_loadd(3, k + 32 * c, dim * 2);
            AMX_SCORES(0) AMX_SCORES(1) AMX_SCORES(2)
        }
        AMX_STORE(0); AMX_STORE(1); AMX_STORE(2);
    }
}

/* acc^T = acc^T * correction + V^T P^T for up to KS keys: per 16 row lanes and 64 dimensions, acc^T in tiles 0-3
 * (four independent chains, loaded and stored once a step), then per 32 key pairs P's two 16-pair halves in tiles
 * 4-5 and V^T's 32-key halves in 6-7; acc scaled beforehand where a lane's correction is not 1. P pairs from
 * `pairs` to the next 16 are zeroed (their scores may be -inf or stale). */
static void accumulate_amx(float *acc, uint32_t *p, const uint32_t *vt, int64_t stride, const __m512 *correction,
                           const int64_t rp, const int64_t dim, int64_t pairs) {
    for (int64_t i2 = pairs; i2 % 16; i2++) memset(p + i2 * rp, 0, sizeof(uint32_t) * (size_t)rp);
    for (int64_t b = 0; b < rp / 16; b++)
        if (_mm512_cmp_ps_mask(correction[b], _mm512_set1_ps(1.0f), _CMP_NEQ_UQ))
            for (int64_t d = 0; d < dim; d++) {
                float *x = acc + d * rp + 16 * b;
                _mm512_store_ps(x, _mm512_mul_ps(_mm512_load_ps(x), correction[b]));
            }
    for (int64_t b = 0; b < rp / 16; b++)
        for (int64_t d0 = 0; d0 < dim; d0 += 64) {
            float *c = acc + d0 * rp + 16 * b;
            _tile_loadd(0, c, rp * 4); _tile_loadd(1, c + 16 * rp, rp * 4);
            _tile_loadd(2, c + 32 * rp, rp * 4); _tile_loadd(3, c + 48 * rp, rp * 4);
            for (int64_t i2 = 0; i2 < pairs; i2 += 32) {
                const int two = pairs > i2 + 16;
                const uint32_t *v = vt + d0 * stride + i2;
                _tile_loadd(4, p + i2 * rp + 16 * b, rp * 4);
                if (two) _tile_loadd(5, p + (i2 + 16) * rp + 16 * b, rp * 4);
#define PV(T) \
                _tile_loadd(6, v + 16 * T * stride, stride * 4); _tile_dpbf16ps(T, 6, 4); \
                if (two) { _tile_loadd(7, v + 16 * T * stride + 16, stride * 4); _tile_dpbf16ps(T, 7, 5); }
                PV(0) PV(1) PV(2) PV(3)
#undef PV
            }
            _tile_stored(0, c, rp * 4); _tile_stored(1, c + 16 * rp, rp * 4);
            _tile_stored(2, c + 32 * rp, rp * 4); _tile_stored(3, c + 48 * rp, rp * 4);
        }
}

INLINE void task(const PrefillArgs *a, const Task *t, Tile *w, const int64_t dim, const int kv_dt) {
    const int64_t first_pos = a->seq_lens[t->s] - a->query_lens[t->s] + t->j0, end = first_pos + t->rows;
    const int64_t first = a->window > 0 && first_pos >= a->window ? first_pos - a->window + 1 : 0;
    const int64_t lo = first_block_key(a, t->s, t->j0);
    const float factor = a->scale * a->k_scale[t->h];
    const int64_t rp = load_queries(a, t, w, dim);
    const uint32_t *q = (const uint32_t *)w->q;
    uint16_t *buf = (uint16_t *)w->k;  /* 16 K rows in bf16 */
    float *s = w->p;
    TileConfig config = ps_amx_full_tiles();
    _tile_loadconfig(&config);
    for (int64_t k0 = first / 16 * 16; k0 < end; k0 += KS) {
        const int64_t n = end - k0 < KS ? end - k0 : KS;
        for (int64_t i = 0; i < n; i += 16)
            scores_amx(key_rows(a, t->s, t->h, k0 + i, lo, end, a->k_cache, a->k_row_scale, dim, kv_dt, buf), q,
                       s + i * rp, rp, dim);
        const int whole = k0 + n - 1 <= first_pos && (a->window <= 0 || k0 >= end - a->window);
        __m512 correction[rp / 16];
        for (int64_t b = 0; b < rp / 16; b++)
            correction[b] = softmax_block(s + 16 * b, w->m + 16 * b, w->l + 16 * b,
                                          (const int32_t *)w->correction + 16 * b, factor, k0, n, a->window, rp, whole);
        accumulate_amx(w->acc, (uint32_t *)s, t->vt + k0 / 2, t->vt_stride, correction, rp, dim, (n + 1) / 2);
    }
    store_rows(a, t, w, rp, dim);
    _tile_release();
}

#define SPECIALIZE(D, KV) \
    if (a->head_dim == D && a->kv_dtype == KV) return task(a, t, w, D, KV)

void prefill_task_amx(const PrefillArgs *a, const Task *t, Tile *w) {
    SPECIALIZE(64, DT_BF16); SPECIALIZE(128, DT_BF16);
    task(a, t, w, a->head_dim, a->kv_dtype);  /* 8-bit caches: long chunks read them gathered into bf16 */
}

#endif
