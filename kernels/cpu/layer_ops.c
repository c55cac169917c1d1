/* The elementwise parts of a Llama decoder layer, fused: RMSNorm (with the residual add before it), SiLU-and-mul,
 * and rotate-half RoPE (built and called by kernels/cpu/native.py; wrapped by kernels/cpu/layer_ops.py).
 *
 * Why: in eager torch each of these is 3-8 separate ops over [tokens, hidden] tensors (casts, pow, mean, rsqrt,
 * muls, flip, add), each a pass over memory plus dispatch; at decode sizes that was ~15% of bf16 step time.
 *
 * Semantics are transformers' in the 16-bit compute dtypes: every place where torch rounds a 16-bit result, this
 * code rounds too (round_to), so outputs differ from torch's only by the order of the RMSNorm sum and expf's last
 * bit. Rows are independent: OpenMP splits them across torch's threads.
 */
#include "isa.h"
#include "native.h"

/* Rounds an fp32 value to what dtype `dt` would store, as fp32 (fp32 itself unchanged). */
INLINE float round_to(float x, int dt) {
    if (dt == DT_BF16) return bf16_to_f32(f32_to_bf16(x));
    if (dt == DT_F16) return (float)(_Float16)x;
    return x;
}

/* Whether a call is worth splitting across threads is the caller's choice (num_threads 1: no parallel region),
 * since it depends on how the pool waits; see SplitThresholds in layer_ops.py. */

/* Row functions take the dtype as a constant and are instantiated per dtype below (ROW_FUNCTIONS): OpenMP outlines
 * a parallel loop's body before inlining, so a dtype passed into the loop would stay a variable there, and its
 * branches would keep gcc from vectorizing. */

/* out = weight * dtype(x * rsqrt(mean(x^2) + eps)) for one row of x [rows, dim] (transformers' LlamaRMSNorm).
 * With `delta`, x is first replaced by dtype(x + delta), written back into x: the residual stream of the next
 * sublayer. Widths that are a multiple of 16 hold the row as fp32 vectors on the stack; others take the scalar loop. */
INLINE void rms_norm_row(void *x, const void *delta, void *out, const void *weight, int64_t dim, float eps,
                         const int dt) {
    if (dim % 16 == 0) {
        const int64_t chunks = dim / 16;
        f32x16 row[chunks], even = {0}, odd = {0};  /* two sums: half the dependency chain */
        for (int64_t c = 0; c < chunks; c++) {
            f32x16 v = load16(x, c, dt);
            if (delta) {
                v = round16(v + load16(delta, c, dt), dt);
                store16(x, c, dt, v);
            }
            row[c] = v;
            if (c & 1) odd += v * v;
            else even += v * v;
        }
        const float inv = 1.0f / sqrtf(hsum16(even + odd) / (float)dim + eps);
        for (int64_t c = 0; c < chunks; c++) store16(out, c, dt, round16(row[c] * inv, dt) * load16(weight, c, dt));
        return;
    }
    float row[dim], squares = 0.0f;
    for (int64_t d = 0; d < dim; d++) {
        row[d] = load_at(x, d, dt);
        if (delta) {
            row[d] = round_to(row[d] + load_at(delta, d, dt), dt);
            store_at(x, d, dt, row[d]);
        }
        squares += row[d] * row[d];
    }
    const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
    for (int64_t d = 0; d < dim; d++) store_at(out, d, dt, round_to(row[d] * inv, dt) * load_at(weight, d, dt));
}

uint16_t ps_silu_bf16[65536 + 2] __attribute__((aligned(64)));

__attribute__((constructor)) static void fill_silu_bf16(void) {
    for (uint32_t g = 0; g < 65536; g += 16) {
        u32x16 bits;
        for (int i = 0; i < 16; i++) bits[i] = (g + i) << 16;
        f32x16 x;
        memcpy(&x, &bits, sizeof x);
        store16(ps_silu_bf16, g / 16, DT_BF16, silu16(x));
    }
}

/* dtype(silu(gate)) for lanes [16c, 16c + 16) of a row of gates: a lookup in bf16 (1.7x the rate of silu16). */
INLINE f32x16 silu16_dt(const void *gates, int64_t c, const int dt) {
    if (dt != DT_BF16) return round16(silu16(load16(gates, c, dt)), dt);
    u16x16 bits;
    memcpy(&bits, (const uint16_t *)gates + 16 * c, sizeof bits);
    return silu16_bf16(bits);
}

/* out [n] = dtype(silu(gate)) * up for one row of gate_up [2n] = [gate | up] (the merged projection's output). */
INLINE void silu_and_mul_row(const void *gate_up, void *out, int64_t n, const int dt) {
    const void *up = (const char *)gate_up + n * elem_size(dt);
    const int64_t chunks = n / 16;
    for (int64_t c = 0; c < chunks; c++)
        store16(out, c, dt, silu16_dt(gate_up, c, dt) * load16(up, c, dt));
    for (int64_t i = 16 * chunks; i < n; i++)
        store_at(out, i, dt, round_to(silu(load_at(gate_up, i, dt)), dt) * load_at(up, i, dt));
}

/* One token's heads: out = x * cos + [x2, x1] * signed_sin, each product and the sum rounded as torch rounds.
 * rotate_half pairs lane d with lane d + dim/2 (then d - dim/2): whole 16-lane chunks when dim/2 is a multiple of
 * 16, lane by lane otherwise. */
INLINE void rope_row(const void *x, const void *cos, const void *signed_sin, void *out, int64_t heads, int64_t dim,
                     const int dt) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        const void *xh = (const char *)x + h * dim * elem_size(dt);
        void *oh = (char *)out + h * dim * elem_size(dt);
        if (half % 16 == 0) {
            for (int64_t c = 0; c < dim / 16; c++) {
                const int64_t pair = c < half / 16 ? c + half / 16 : c - half / 16;
                const f32x16 a = round16(load16(xh, c, dt) * load16(cos, c, dt), dt);
                const f32x16 b = round16(load16(xh, pair, dt) * load16(signed_sin, c, dt), dt);
                store16(oh, c, dt, a + b);
            }
            continue;
        }
        for (int64_t d = 0; d < dim; d++) {
            const int64_t pair = d < half ? d + half : d - half;
            const float a = round_to(load_at(xh, d, dt) * load_at(cos, d, dt), dt);
            const float b = round_to(load_at(xh, pair, dt) * load_at(signed_sin, d, dt), dt);
            store_at(oh, d, dt, a + b);
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
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        row(AT(x, dt, r * dim), delta ? AT(delta, dt, r * dim) : NULL, AT(out, dt, r * dim), weight, dim, eps);
    return 0;
}

int pagedserve_silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t n, int dt, int num_threads) {
    void (*row)(const void *, void *, int64_t) =
        dt == DT_BF16 ? silu_and_mul_bf16 : dt == DT_F16 ? silu_and_mul_f16 : silu_and_mul_f32;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) row(AT(gate_up, dt, r * 2 * n), AT(out, dt, r * n), n);
    return 0;
}

/* x [T, heads, dim] with rows `x_token_stride` elements apart (a slice of the fused q/k/v output); cos and
 * signed_sin [T, dim]; out [T, heads, dim] dense. */
int pagedserve_rope(const void *x, int64_t x_token_stride, const void *cos, const void *signed_sin, void *out,
                    int64_t tokens, int64_t heads, int64_t dim, int dt, int num_threads) {
    void (*row)(const void *, const void *, const void *, void *, int64_t, int64_t) =
        dt == DT_BF16 ? rope_bf16 : dt == DT_F16 ? rope_f16 : rope_f32;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        row(AT(x, dt, t * x_token_stride), AT(cos, dt, t * dim), AT(signed_sin, dt, t * dim),
            AT(out, dt, t * heads * dim), heads, dim);
    return 0;
}

/* The greedy pick of one logits row: its maximum (NaN when the row holds a NaN, as torch's amax gives) and the
 * first index holding it. Why here: torch's amax, isfinite and a chunked argmax over a row were five passes and
 * ~100-150 us per step on the 49k-token vocabularies (a speculative step verifies 5 rows); this is one pass plus
 * a scan that stops at the maximum. */
#if defined(PS_AVX512)
#endif

static float row_max(const float *x, int64_t n) {
#if defined(PS_AVX512)
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(v, m);
    }
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(v, m);
    }
    return nan ? NAN : _mm512_reduce_max_ps(m);
#else
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(x[i])) return NAN;
        m = x[i] > m ? x[i] : m;
    }
    return m;
#endif
}

/* The first index of m in x (m is there). */
static int64_t first_index_of(const float *x, int64_t n, float m) {
    int64_t i = 0;
#if defined(PS_AVX512)
    const __m512 target = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    while (x[i] != m) i++;
    return i;
}

int pagedserve_row_max_argmax(const float *x, int64_t rows, int64_t cols, int64_t row_stride, float *max,
                              int64_t *index, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * row_stride, m = row_max(row, cols);
        max[r] = m;
        index[r] = isnan(m) ? 0 : first_index_of(row, cols, m);
    }
    return 0;
}
