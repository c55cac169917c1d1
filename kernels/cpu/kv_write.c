/* The KV write of a step for caches stored in the compute dtype (built and called by kernels/cpu/native.py, used by
 * kernels/native_attention.py): each new token's K and V rows copied into their slots of the head-major storage.
 *
 * Why C: torch's advanced-index assignment (storage[:, slots] = rows) costs ~26 us per tensor and layer at decode
 * sizes, most of it dispatch and index checking, for a few KB of copies. int8 and FP8 caches quantize here too (and
 * the 8-bit gather of long prefill chunks reads them back). Slots are checked against the storage here, so a bad
 * slot is an error, not a stray write.
 */
#include "isa.h"
#include "kv_dot.h"
#include "kv_fp8.h"
#include "kv_int8.h"
#include "native.h"

/* key/value: [T, Hkv, D] rows with the given token strides (elements), heads dense; storage: [Hkv, slots, D]. */
int pagedserve_write_kv(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *k_storage,
                        char *v_storage, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                        int64_t num_slots, int64_t head_dim, int64_t elem) {
    const size_t row = (size_t)head_dim * elem;
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return -1;
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const size_t dst = ((size_t)h * num_slots + slot_mapping[t]) * row;
            memcpy(k_storage + dst, key + ((size_t)t * key_stride + h * head_dim) * elem, row);
            memcpy(v_storage + dst, value + ((size_t)t * value_stride + h * head_dim) * elem, row);
        }
    }
    return 0;
}

/* The same for an int8 cache: each row quantized (quantize_row_int8, bit for bit the torch path's) into its slot,
 * its fp16 scale into the head-major [Hkv, slots] scale storage. key/value rows in the compute dtype src_dt. */
int pagedserve_write_kv_int8(const char *key, int64_t key_stride, const char *value, int64_t value_stride, int src_dt,
                             int8_t *k_storage, int8_t *v_storage, _Float16 *k_scales, _Float16 *v_scales,
                             const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads, int64_t num_slots,
                             int64_t head_dim) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return -1;
    float *row = malloc(sizeof(float) * (size_t)head_dim);
    if (!row) return -2;
    const int64_t elem = elem_size(src_dt);
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t at = h * num_slots + slot_mapping[t];
            const char *k = key + (t * key_stride + h * head_dim) * elem, *v = value + (t * value_stride + h * head_dim) * elem;
            if (int8_row_fits_x16(head_dim)) {
                quantize_row_int8_x16(k, src_dt, head_dim / 16, k_storage + at * head_dim, k_scales + at);
                quantize_row_int8_x16(v, src_dt, head_dim / 16, v_storage + at * head_dim, v_scales + at);
                continue;
            }
            for (int64_t d = 0; d < head_dim; d++) row[d] = load_at(k, d, src_dt);
            quantize_row_int8(row, head_dim, k_storage + at * head_dim, k_scales + at);
            for (int64_t d = 0; d < head_dim; d++) row[d] = load_at(v, d, src_dt);
            quantize_row_int8(row, head_dim, v_storage + at * head_dim, v_scales + at);
        }
    }
    free(row);
    return 0;
}

/* One tile's rows dequantized into dst: int8 times each row's scale; FP8 through fp16 bits (kv_row16: one
 * conversion per 16 lanes, where load16 takes a shift, a mask and a multiply more, and an fp32 subnormal, which costs
 * the multiply a microcode assist, for each e4m3 subnormal), its power of two folded into the head's scale: 2^8 x
 * scale is exact, so each value is still rounded once, to the same bits. Inlined with constant dtypes for the long
 * prefill's bf16: its loads and stores then carry no dtype branches (benchmarks/kv_write_ab.py). */
INLINE void gather_tile(const char *storage, const _Float16 *row_scales, float head, int64_t tile, int64_t block_size,
                        int64_t chunks, char *dst, const int kv_dt, const int out_dt) {
    const size_t in_row = (size_t)16 * chunks * elem_size(kv_dt), out_row = (size_t)16 * chunks * elem_size(out_dt);
    for (int64_t r = 0; r < block_size; r++) {
        const int64_t slot = tile * block_size + r;
        const char *row = storage + (size_t)slot * in_row;
        char *out = dst + (size_t)r * out_row;
        if (kv_dt == DT_I8) {
            const float scale = (float)row_scales[slot];
            for (int64_t c = 0; c < chunks; c++) store16(out, c, out_dt, load16(row, c, kv_dt) * scale);
        } else {
            for (int64_t c = 0; c < chunks; c++) store16(out, c, out_dt, kv_row16(row, c, kv_dt) * head);
        }
    }
}

/* The prefill reads an 8-bit cache back for long chunks: tiles[j] (j = h * per_head + i, rows of the storage viewed as
 * [Hkv * num_blocks, block_size, D]) dequantized into out [Hkv, per_head * block_size, D] of a compute dtype, each
 * value times its row's scale (int8) or its head's (FP8) in fp32 and rounded once, bit for bit kv_quant.gather_kv.
 * One pass where torch took five (index_select, widen, scale, multiply, narrow), each a trip over memory and an
 * allocation: at 4k keys that was most of an 8-bit cache's extra prefill time. head_dim a multiple of 16. */
int pagedserve_gather_kv(const char *storage, int kv_dt, const _Float16 *row_scales, const float *head_scales,
                         const int64_t *tiles, int64_t per_head, int64_t num_kv_heads, int64_t num_tiles,
                         int64_t block_size, int64_t head_dim, char *out, int out_dt, int num_threads) {
    const int64_t count = per_head * num_kv_heads, chunks = head_dim / 16;
    for (int64_t j = 0; j < count; j++)
        if (tiles[j] < 0 || tiles[j] >= num_tiles) return -1;
    const size_t out_tile = (size_t)block_size * head_dim * elem_size(out_dt);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t j = 0; j < count; j++) {
        const float head = kv_dt == DT_I8 ? 1.0f : head_scales[j / per_head] * kv_row16_factor(kv_dt);
        char *dst = out + (size_t)j * out_tile;
        if (out_dt == DT_BF16 && kv_dt == DT_I8)
            gather_tile(storage, row_scales, head, tiles[j], block_size, chunks, dst, DT_I8, DT_BF16);
        else if (out_dt == DT_BF16 && kv_dt == DT_E4M3)
            gather_tile(storage, row_scales, head, tiles[j], block_size, chunks, dst, DT_E4M3, DT_BF16);
        else
            gather_tile(storage, row_scales, head, tiles[j], block_size, chunks, dst, kv_dt, out_dt);
    }
    return 0;
}

/* The KV write of an FP8 cache: each value divided by its head's scale, clamped to the finite range and rounded to
 * nearest even, byte for byte kv_quant.quantize_for_cache + the torch store (which took five passes and an
 * index_put per tensor: an FP8 prefill's largest extra cost after the gather). */
int pagedserve_write_kv_fp8(const char *key, int64_t key_stride, const char *value, int64_t value_stride, int src_dt,
                            int kv_dt, uint8_t *k_storage, uint8_t *v_storage, const float *k_scale,
                            const float *v_scale, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                            int64_t num_slots, int64_t head_dim) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return -1;
    const int e4m3 = kv_dt == DT_E4M3;
    const int64_t elem = elem_size(src_dt);
    for (int64_t t = 0; t < num_tokens; t++)
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t at = (h * num_slots + slot_mapping[t]) * head_dim;
            fp8_row(key + (t * key_stride + h * head_dim) * elem, src_dt, k_scale[h], head_dim, e4m3, k_storage + at);
            fp8_row(value + (t * value_stride + h * head_dim) * elem, src_dt, v_scale[h], head_dim, e4m3,
                    v_storage + at);
        }
    return 0;
}
