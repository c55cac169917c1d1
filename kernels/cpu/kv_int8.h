/* int8 KV rows with one fp16 scale per row, quantized at write time (one row, or 16 lanes at a time): the native
 * KV write (kv_write.c) and the C decode step's row store (decode_step.c). */
#ifndef PAGEDSERVE_CPU_KV_INT8_H
#define PAGEDSERVE_CPU_KV_INT8_H

#include "native.h"

/* One row of fp32 values -> int8 and its fp16 scale, bit for bit as kernels/kv_quant.py's quantize_rows_int8:
 * scale = fp16(min(amax / 127, 65504)), stored = clamp(rint(x / scale), -127, 127) (IEEE division, ties to even);
 * a zero scale stores zeros. */
static inline void quantize_row_int8(const float *x, int64_t dim, int8_t *q, _Float16 *scale) {
    float amax = 0.0f;
    for (int64_t d = 0; d < dim; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float s = amax / 127.0f;
    const _Float16 half = (_Float16)(s > 65504.0f ? 65504.0f : s);
    const float divisor = (float)half;
    for (int64_t d = 0; d < dim; d++) {
        float y = divisor > 0.0f ? rintf(x[d] / divisor) : 0.0f;
        y = y > 127.0f ? 127.0f : y < -127.0f ? -127.0f : y;
        q[d] = (int8_t)y;
    }
    *scale = half;
}

/* Whether a row of `dim` values takes quantize_row_int8_x16: whole 16-lane chunks, at most its 16 registers' worth. */
INLINE int int8_row_fits_x16(int64_t dim) { return dim % 16 == 0 && dim <= 256; }

/* quantize_row_int8 on 16 lanes at a time, the same bits: the amax is exact, the scale computed once as there, each
 * value divided (IEEE, as the scalar division) and rounded to nearest even by adding and subtracting 1.5 * 2^23
 * (exact for |y| < 2^22; larger quotients, only when the scale saturates, clamp to 127 either way). The scalar loop
 * (a conversion, division and rintf per value) was a few percent of an int8 prefill layer, and in the C decode step
 * about 35 us a step at 2 rows over 30 layers (kv_write.c's prefill write and decode_step.c's row store share it). */
INLINE void quantize_row_int8_x16(const char *src, int src_dt, int64_t chunks, int8_t *q, _Float16 *scale) {
    f32x16 x[16], peak = {0};
    for (int64_t c = 0; c < chunks; c++) {
        x[c] = load16(src, c, src_dt);
        i32x16 bits;
        memcpy(&bits, &x[c], sizeof bits);
        bits &= 0x7fffffff;
        f32x16 mag;
        memcpy(&mag, &bits, sizeof mag);
        peak = max16(mag, peak);  /* NaN lanes compare false: skipped, as by the scalar max */
    }
    const float amax = hmax16(peak), s = amax / 127.0f;
    const _Float16 half = (_Float16)(s > 65504.0f ? 65504.0f : s);
    const float divisor = (float)half;
    for (int64_t c = 0; c < chunks; c++) {
        f32x16 y = divisor > 0.0f ? x[c] / divisor : (f32x16){0};
        y = (y + 0x1.8p23f) - 0x1.8p23f;
        y = select16(gt16(y, splat16(127.0f)), splat16(127.0f), y);
        y = select16(lt16(y, splat16(-127.0f)), splat16(-127.0f), y);
        const i32x16 n = __builtin_convertvector(y, i32x16);
        for (int i = 0; i < 16; i++) q[16 * c + i] = (int8_t)n[i];
    }
    *scale = half;
}

#endif
