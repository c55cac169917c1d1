/* The elementwise parts of a Llama decoder layer, fused: RMSNorm (with the residual add before it), SiLU-and-mul,
 * and rotate-half RoPE (built and called by kernels/cpu_native.py; wrapped by kernels/cpu_layer_ops.py).
 *
 * Why: in eager torch each of these is 3-8 separate ops over [tokens, hidden] tensors (casts, pow, mean, rsqrt,
 * muls, flip, add), each a pass over memory plus dispatch; at decode sizes that was ~15% of bf16 step time.
 *
 * Semantics are transformers' in the 16-bit compute dtypes: every place where torch rounds a 16-bit result, this
 * code rounds too (round_to), so outputs differ from torch's only by the order of the RMSNorm sum and expf's last
 * bit. Rows are independent: OpenMP splits them across torch's threads.
 */
#include "cpu_native.h"

/* Rounds an fp32 value to what dtype `dt` would store, as fp32 (fp32 itself unchanged). */
INLINE float round_to(float x, int dt) {
    if (dt == DT_BF16) return bf16_to_f32(f32_to_bf16(x));
    if (dt == DT_F16) return (float)(_Float16)x;
    return x;
}

/* Small inputs stay on the calling thread: waking the pool costs more than the work. */
#define PARALLEL_MIN_ELEMENTS 16384

/* Row functions take the dtype as a constant and are instantiated per dtype below (ROW_FUNCTIONS): OpenMP outlines
 * a parallel loop's body before inlining, so a dtype passed into the loop would stay a variable there, and its
 * branches would keep gcc from vectorizing. */

/* out = weight * dtype(x * rsqrt(mean(x^2) + eps)) for one row of x [rows, dim] (transformers' LlamaRMSNorm).
 * With `delta`, x is first replaced by dtype(x + delta), written back into x: the residual stream of the next
 * sublayer. */
INLINE void rms_norm_row(void *x, const void *delta, void *out, const void *weight, int64_t dim, float eps,
                         const int dt) {
    float row[dim], squares = 0.0f;
    if (delta) {
        for (int64_t d = 0; d < dim; d++) {
            row[d] = round_to(load_at(x, d, dt) + load_at(delta, d, dt), dt);
            store_at(x, d, dt, row[d]);
        }
    } else {
        for (int64_t d = 0; d < dim; d++) row[d] = load_at(x, d, dt);
    }
#pragma omp simd reduction(+ : squares)
    for (int64_t d = 0; d < dim; d++) squares += row[d] * row[d];
    const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
    for (int64_t d = 0; d < dim; d++) store_at(out, d, dt, round_to(row[d] * inv, dt) * load_at(weight, d, dt));
}

/* out [n] = dtype(silu(gate)) * up for one row of gate_up [2n] = [gate | up] (the merged projection's output). */
INLINE void silu_and_mul_row(const void *gate_up, void *out, int64_t n, const int dt) {
    for (int64_t i = 0; i < n; i++) {
        const float g = load_at(gate_up, i, dt), u = load_at(gate_up, n + i, dt);
        const float e = exp_nonpositive(-fabsf(g));  /* e^-|g|: never overflows */
        const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
        store_at(out, i, dt, round_to(g * sigmoid, dt) * u);
    }
}

/* One token's heads: out = x * cos + [x2, x1] * signed_sin, each product and the sum rounded as torch rounds. */
INLINE void rope_row(const void *x, const void *cos, const void *signed_sin, void *out, int64_t heads, int64_t dim,
                     const int dt) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t base = h * dim;
        for (int64_t d = 0; d < dim; d++) {  /* rotate_half: lane d pairs with lane d + dim/2, then d - dim/2 */
            const int64_t pair = d < half ? d + half : d - half;
            const float a = round_to(load_at(x, base + d, dt) * load_at(cos, d, dt), dt);
            const float b = round_to(load_at(x, base + pair, dt) * load_at(signed_sin, d, dt), dt);
            store_at(out, base + d, dt, a + b);
        }
    }
}

#define ROW_FUNCTIONS(SUFFIX, DT)                                                                                  \
    static void rms_norm_##SUFFIX(void *x, const void *delta, void *out, const void *w, int64_t dim, float eps) { \
        rms_norm_row(x, delta, out, w, dim, eps, DT);                                                              \
    }                                                                                                              \
    static void silu_and_mul_##SUFFIX(const void *gate_up, void *out, int64_t n) {                                 \
        silu_and_mul_row(gate_up, out, n, DT);                                                                     \
    }                                                                                                              \
    static void rope_##SUFFIX(const void *x, const void *cos, const void *sin, void *out, int64_t heads,           \
                              int64_t dim) {                                                                       \
        rope_row(x, cos, sin, out, heads, dim, DT);                                                                \
    }
ROW_FUNCTIONS(f32, DT_F32)
ROW_FUNCTIONS(bf16, DT_BF16)
ROW_FUNCTIONS(f16, DT_F16)

#define AT(base, dt, offset) ((void *)((char *)(base) + (offset) * elem_size(dt)))

int pagedserve_rms_norm(void *x, const void *delta, void *out, const void *weight, int64_t rows, int64_t dim,
                        float eps, int dt, int num_threads) {
    void (*row)(void *, const void *, void *, const void *, int64_t, float) =
        dt == DT_BF16 ? rms_norm_bf16 : dt == DT_F16 ? rms_norm_f16 : rms_norm_f32;
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        row(AT(x, dt, r * dim), delta ? AT(delta, dt, r * dim) : NULL, AT(out, dt, r * dim), weight, dim, eps);
    return 0;
}

int pagedserve_silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t n, int dt, int num_threads) {
    void (*row)(const void *, void *, int64_t) =
        dt == DT_BF16 ? silu_and_mul_bf16 : dt == DT_F16 ? silu_and_mul_f16 : silu_and_mul_f32;
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; r++) row(AT(gate_up, dt, r * 2 * n), AT(out, dt, r * n), n);
    return 0;
}

/* x [T, heads, dim] with rows `x_token_stride` elements apart (a slice of the fused q/k/v output); cos and
 * signed_sin [T, dim]; out [T, heads, dim] dense. */
int pagedserve_rope(const void *x, int64_t x_token_stride, const void *cos, const void *signed_sin, void *out,
                    int64_t tokens, int64_t heads, int64_t dim, int dt, int num_threads) {
    void (*row)(const void *, const void *, const void *, void *, int64_t, int64_t) =
        dt == DT_BF16 ? rope_bf16 : dt == DT_F16 ? rope_f16 : rope_f32;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * dim >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        row(AT(x, dt, t * x_token_stride), AT(cos, dt, t * dim), AT(signed_sin, dt, t * dim),
            AT(out, dt, t * heads * dim), heads, dim);
    return 0;
}
