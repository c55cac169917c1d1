/* A whole decode step of the Llama family or Gemma 3 in one call: token ids in, fp32 logits out (built and called by
 * kernels/cpu/native.py, driven by engine/native_step.py).
 *
 * Why: at 1-8 decode rows a step is bound by reading the weights once, yet the eager torch path spent about as
 * long again in per-op dispatch and Python (~15 ops per layer). Here a layer is: RMSNorm, q/k/v projection, (Qwen3,
 * Gemma 3: an RMSNorm of each q and k head), RoPE (Gemma 3: the layer's own table), KV write into the paged cache,
 * the decode attention kernel (decode_attention.c), o projection, (Gemma 3: its RMSNorm), residual, RMSNorm,
 * gate/up projection, SiLU- or tanh-GELU-and-mul, down projection, (Gemma 3: its RMSNorm); then the final norm,
 * the LM head and (a config's) logit softcapping; all linears through their ps_linear pointers
 * (linear.h), whatever the weight format, so each parallelizes itself and this loop stays on one thread.
 *
 * Numerics: the hidden state, norms, RoPE, attention queries and outputs stay fp32 (the torch path rounds each to
 * the model's dtype); a linear rounds its input to its weights' dtype. So in fp32 only summation orders differ
 * from the torch path; in bf16 the native step carries more precision than the torch path, which differs from it
 * by about bf16's rounding (~2^-8 relative) per layer.
 */
#include "isa.h"
#include "decode_attention.h"
#include "linear.h"
#include "kv_fp8.h"
#include "kv_int8.h"

typedef struct {
    ps_linear qkv[3]; int64_t n_qkv;            /* one merged q/k/v linear, or q, k, v: outputs concatenated */
    ps_linear o;
    ps_linear gate_up[2]; int64_t n_gate_up;    /* merged [gate | up], or gate, up */
    ps_linear down;
    const void *input_norm, *post_norm;         /* [hidden], norm_dtype */
    const void *k_cache, *v_cache;              /* head-major [Hkv, num_blocks, block_size, D], kv_dtype */
    const float *k_scale, *v_scale;             /* [Hkv] */
    _Float16 *k_row_scale, *v_row_scale;        /* int8: [Hkv, num_blocks, block_size]; else NULL */
    const float *k_rotation;                    /* [D, D] fp32 or NULL: the cache holds K R, queries use Q R */
    const float *k_offset;                      /* [Hkv, D] fp32 or NULL: subtracted from K R before it is stored */
    int64_t window;                             /* 0: full attention */
    const void *q_norm, *k_norm;                /* [D], norm_dtype, or NULL: Qwen3's RMSNorm of each q / k head */
    const void *attn_out_norm, *mlp_out_norm;   /* [hidden], norm_dtype, or NULL: Gemma 3's norms of each
                                                 * sublayer's output before its residual add */
    const float *cos, *signed_sin;              /* this layer's RoPE table, or NULL: the model's */
} StepLayer;

typedef struct {
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, num_blocks, block_size, vocab;
    int64_t max_positions;
    float eps, attn_scale, logit_softcap;       /* softcap 0: none */
    int norm_dtype, kv_dtype, activation;       /* activation: ACT_SILU or ACT_GELU_TANH */
    const float *cos, *signed_sin;              /* [max_positions, D] fp32, sin's first half negated */
    const void *final_norm;
    const StepLayer *layers;
    ps_linear lm_head;
} StepModel;

typedef struct {
    const int64_t *token_ids, *positions, *slots, *rows;  /* [n]; rows = 0..n-1 (the attention kernel's row map) */
    const int32_t *seq_lens, *block_tables;
    int64_t block_table_stride, max_seq_len;
    const float *embed_rows;  /* [n, hidden]: the rows' token embeddings, looked up by the caller in the
                               * embedding's own storage (dense or packed blocks) */
    float *logits;                                        /* [n, vocab] */
} StepBatch;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };  /* decoder_stack.py's ACTIVATIONS, in order */

PS_SIZEOF(step_layer, StepLayer)
PS_SIZEOF(step_model, StepModel)
PS_SIZEOF(step_batch, StepBatch)
PS_SIZEOF(linear, ps_linear)

/* One K or V row (fp32, already rotated for K) into its slot of head h's tiles, in the cache's dtype. */
static void store_kv_row(const StepModel *m, void *cache, _Float16 *row_scales, const float *row, float scale,
                         int64_t h, int64_t slot) {
    const int64_t dim = m->head_dim, at = (h * m->num_blocks * m->block_size + slot) * dim;
    if (m->kv_dtype == DT_I8) {  /* kv_int8.h / kv_fp8.h: the prefill write's forms, the same bytes */
        if (int8_row_fits_x16(dim))
            quantize_row_int8_x16((const char *)row, DT_F32, dim / 16, (int8_t *)cache + at, row_scales + at / dim);
        else
            quantize_row_int8(row, dim, (int8_t *)cache + at, row_scales + at / dim);
        return;
    }
    if (m->kv_dtype == DT_E4M3 || m->kv_dtype == DT_E5M2) {
        fp8_row((const char *)row, DT_F32, scale, dim, m->kv_dtype == DT_E4M3, (uint8_t *)cache + at);
        return;
    }
    for (int64_t d = 0; d < dim; d++) store_at(cache, at + d, m->kv_dtype, row[d]);
}

/* out = x * rsqrt(mean(x^2) + eps) * w for n rows; with delta, x += delta first (the residual stream). */
static void rms_norm_rows(float *x, const float *delta, float *out, const void *w, int dt, int64_t n, int64_t dim,
                          float eps) {
    for (int64_t r = 0; r < n; r++) {
        float *xr = x + r * dim, sum = 0.0f;
        if (delta)
            for (int64_t d = 0; d < dim; d++) xr[d] += delta[r * dim + d];
        for (int64_t d = 0; d < dim; d++) sum += xr[d] * xr[d];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) out[r * dim + d] = xr[d] * inv * load_at(w, d, dt);
    }
}

enum { ROT_LANES_MAX = 16 };  /* head_dim <= 256 in 16-lane vectors: the rotation's sums stay in registers */

/* out = tmp R for one head: out[d] = sum over e, in order, of tmp[e] R[e][d], each term added as the scalar loop
 * below adds it (contracted to one multiply-add where the build has FMA: -ffp-contract=fast), so the bits are the
 * scalar loop's; but the sums stay in registers across e, where the scalar loop stored and reloaded every output
 * for every e: ~0.15 ms per row of an int8 or FP8 decode step (their caches rotate K; SmolLM2, 2 threads, noisy). */
#if defined(PS_AVX2_ONLY)
/* rotate_head's sums for output columns [c0, c0 + 8 n8), n8 <= 8 a constant after inlining: without AVX-512 the
 * 16-lane accumulators of a runtime count lived on the stack (a load, FMA and store per 16 lanes and e: 2.7% of
 * an AVX2 int8 decode step at 4k keys, on the one thread that runs the row loop); 8 ymm sums stay in registers. The
 * same terms in the same order, so the same bits. */
INLINE void rotate_cols8(const float *tmp, const float *rot, int64_t dim, float *out, int64_t c0, const int n8) {
    f32x8 acc[8];
    for (int c = 0; c < n8; c++) acc[c] = (f32x8){0};
    for (int64_t e = 0; e < dim; e++) {
        const f32x8 t = tmp[e] - (f32x8){0};  /* a broadcast that keeps -0 */
        for (int c = 0; c < n8; c++) {
            f32x8 r;
            memcpy(&r, rot + e * dim + c0 + 8 * c, sizeof r);
            acc[c] += t * r;
        }
    }
    for (int c = 0; c < n8; c++) _mm256_storeu_ps(out + c0 + 8 * c, (__m256)acc[c]);  /* no address of acc taken */
}
#endif

static void rotate_head(const float *tmp, const float *rot, int64_t dim, float *out) {
    if (dim % 16 || dim > 16 * ROT_LANES_MAX) {
        for (int64_t d = 0; d < dim; d++) out[d] = 0.0f;
        for (int64_t e = 0; e < dim; e++)
            for (int64_t d = 0; d < dim; d++) out[d] += tmp[e] * rot[e * dim + d];
        return;
    }
#if defined(PS_AVX2_ONLY)
    int64_t c0 = 0;
    for (; c0 + 64 <= dim; c0 += 64) rotate_cols8(tmp, rot, dim, out, c0, 8);
    if (dim - c0 == 16) rotate_cols8(tmp, rot, dim, out, c0, 2);
    else if (dim - c0 == 32) rotate_cols8(tmp, rot, dim, out, c0, 4);
    else if (dim - c0 == 48) rotate_cols8(tmp, rot, dim, out, c0, 6);
#else
    const int64_t lanes = dim / 16;
    f32x16 acc[ROT_LANES_MAX];
    for (int64_t c = 0; c < lanes; c++) acc[c] = (f32x16){0};
    for (int64_t e = 0; e < dim; e++) {
        const f32x16 t = tmp[e] - (f32x16){0};  /* a broadcast that keeps -0 */
        for (int64_t c = 0; c < lanes; c++) {
            f32x16 r;
            memcpy(&r, rot + e * dim + 16 * c, sizeof r);
            acc[c] += t * r;
        }
    }
    memcpy(out, acc, sizeof(float) * dim);
#endif
}

/* Rotate-half RoPE of `heads` heads of one row in place, then (K rotation) x <- x R. */
static void rope_heads(float *x, int64_t heads, int64_t dim, const float *cos, const float *ssin, const float *rot,
                       float *tmp) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * dim;
        for (int64_t d = 0; d < dim; d++) tmp[d] = xh[d] * cos[d] + xh[d < half ? d + half : d - half] * ssin[d];
        if (!rot) { memcpy(xh, tmp, sizeof(float) * dim); continue; }
        rotate_head(tmp, rot, dim, xh);
    }
}

/* y [n, sum of outs] = the parts' outputs side by side; `tmp` holds one part's [n, out] when there are several. */
static int concat_linears(const ps_linear *parts, int64_t count, const float *x, int64_t n, float *y, float *tmp) {
    if (count == 1) return ps_linear_apply(&parts[0], x, n, y);
    int64_t width = 0, offset = 0;
    for (int64_t i = 0; i < count; i++) width += parts[i].out_features;
    for (int64_t i = 0; i < count; i++) {
        const int64_t out = parts[i].out_features;
        const int status = ps_linear_apply(&parts[i], x, n, tmp);
        if (status) return status;
        for (int64_t r = 0; r < n; r++) memcpy(y + r * width + offset, tmp + r * out, sizeof(float) * out);
        offset += out;
    }
    return 0;
}

typedef struct { float *residual, *delta, *h, *qkv, *attn, *gate_up, *act, *tmp, *head; } Buffers;

static int attention_block(const StepModel *m, const StepLayer *L, const StepBatch *b, int64_t n, Buffers *w,
                           int num_threads) {
    const int64_t H = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, width = (H + 2 * Hkv) * D;
    int status = concat_linears(L->qkv, L->n_qkv, w->h, n, w->qkv, w->tmp);
    if (status) return status;
    for (int64_t r = 0; r < n; r++) {
        float *q = w->qkv + r * width, *k = q + H * D, *v = k + Hkv * D;
        const float *cos = (L->cos ? L->cos : m->cos) + b->positions[r] * D;
        const float *ssin = (L->signed_sin ? L->signed_sin : m->signed_sin) + b->positions[r] * D;
        if (L->q_norm) {  /* in place: each head's sum of squares is taken before any of it is written */
            rms_norm_rows(q, NULL, q, L->q_norm, m->norm_dtype, H, D, m->eps);
            rms_norm_rows(k, NULL, k, L->k_norm, m->norm_dtype, Hkv, D, m->eps);
        }
        rope_heads(q, H, D, cos, ssin, L->k_rotation, w->head);
        rope_heads(k, Hkv, D, cos, ssin, L->k_rotation, w->head);
        if (L->k_offset)  /* FP8 K centring (kv_scales.py): softmax ignores the per-query shift it causes */
            for (int64_t d = 0; d < Hkv * D; d++) k[d] -= L->k_offset[d];
        memcpy(w->attn + r * H * D, q, sizeof(float) * H * D);  /* the query rows, dense for the kernel */
        for (int64_t h = 0; h < Hkv; h++) {
            store_kv_row(m, (void *)L->k_cache, L->k_row_scale, k + h * D, L->k_scale[h], h, b->slots[r]);
            store_kv_row(m, (void *)L->v_cache, L->v_row_scale, v + h * D, L->v_scale[h], h, b->slots[r]);
        }
    }
    DecodeArgs a = {
        .query = w->attn, .q_token_stride = H * D, .out = w->qkv, .q_dtype = DT_F32,
        .k_cache = L->k_cache, .v_cache = L->v_cache, .kv_dtype = m->kv_dtype,
        .k_scale = L->k_scale, .v_scale = L->v_scale, .k_row_scale = L->k_row_scale, .v_row_scale = L->v_row_scale,
        .block_tables = b->block_tables, .block_table_stride = b->block_table_stride,
        .seq_lens = b->seq_lens, .rows = b->rows,
        .num_heads = H, .num_kv_heads = Hkv, .head_dim = D, .num_blocks = m->num_blocks,
        .block_size = m->block_size, .scale = m->attn_scale, .window = L->window,
    };
    /* out [n, H, D] dense into the qkv buffer, free now (it is wider) */
    if (pagedserve_decode_attention(&a, n, b->max_seq_len, num_threads)) return -3;
    if ((status = ps_linear_apply(&L->o, w->qkv, n, w->delta))) return status;
    if (L->attn_out_norm)  /* in place, as the q/k norms */
        rms_norm_rows(w->delta, NULL, w->delta, L->attn_out_norm, m->norm_dtype, n, m->hidden, m->eps);
    return 0;
}

/* gelu(g) with tanh's approximation: 0.5 g (1 + tanh(y)) = g sigmoid(2 y), y = sqrt(2 / pi) (g + 0.044715 g^3);
 * the sigmoid from e^-|2y| as silu's, so it never overflows and the loop vectorizes. */
INLINE float gelu_tanh(float g) {
    const float y2 = 1.5957691216057308f * (g + 0.044715f * g * g * g);
    const float e = exp_nonpositive(-fabsf(y2));
    return g * (y2 >= 0.0f ? 1.0f : e) / (1.0f + e);
}

static int mlp_block(const StepModel *m, const StepLayer *L, int64_t n, Buffers *w) {
    const int64_t inter = m->intermediate;
    int status = concat_linears(L->gate_up, L->n_gate_up, w->h, n, w->gate_up, w->tmp);
    if (status) return status;
    for (int64_t r = 0; r < n; r++) {
        const float *gate = w->gate_up + r * 2 * inter, *up = gate + inter;
        float *act = w->act + r * inter;
        if (m->activation == ACT_GELU_TANH)
            for (int64_t i = 0; i < inter; i++) act[i] = gelu_tanh(gate[i]) * up[i];
        else
            for (int64_t i = 0; i < inter; i++) act[i] = silu(gate[i]) * up[i];
    }
    if ((status = ps_linear_apply(&L->down, w->act, n, w->delta))) return status;
    if (L->mlp_out_norm)
        rms_norm_rows(w->delta, NULL, w->delta, L->mlp_out_norm, m->norm_dtype, n, m->hidden, m->eps);
    return 0;
}

static int check_batch(const StepModel *m, const StepBatch *b, int64_t n) {
    for (int64_t r = 0; r < n; r++) {
        if (b->token_ids[r] < 0 || b->token_ids[r] >= m->vocab) return -10;
        if (b->positions[r] < 0 || b->positions[r] >= m->max_positions) return -11;
        if (b->slots[r] < 0 || b->slots[r] >= m->num_blocks * m->block_size) return -12;
    }
    return 0;
}

static int run_layers(const StepModel *m, const StepBatch *b, int64_t n, Buffers *w, int num_threads) {
    const int64_t hid = m->hidden;
    for (int64_t r = 0; r < n; r++)
        for (int64_t d = 0; d < hid; d++)
            w->residual[r * hid + d] = b->embed_rows[r * hid + d];
    for (int64_t l = 0; l < m->num_layers; l++) {
        const StepLayer *L = &m->layers[l];
        rms_norm_rows(w->residual, l ? w->delta : NULL, w->h, L->input_norm, m->norm_dtype, n, hid, m->eps);
        int status = attention_block(m, L, b, n, w, num_threads);
        if (status) return status;
        rms_norm_rows(w->residual, w->delta, w->h, L->post_norm, m->norm_dtype, n, hid, m->eps);
        if ((status = mlp_block(m, L, n, w))) return status;
    }
    rms_norm_rows(w->residual, m->num_layers ? w->delta : NULL, w->h, m->final_norm, m->norm_dtype, n, hid, m->eps);
    const int status = ps_linear_apply(&m->lm_head, w->h, n, b->logits);
    if (status || m->logit_softcap == 0.0f) return status;
    /* tanh(x) = sign(x) (1 - e) / (1 + e), e = e^-2|x|: branch-free, so this pass over n x vocab logits
     * vectorizes where scalar tanhf took ~2 ms a row of a 262k vocabulary; within ~1e-7 of tanhf absolute */
    const float cap = m->logit_softcap;
    for (int64_t i = 0; i < n * m->vocab; i++) {
        const float x = b->logits[i] / cap, e = exp_nonpositive(-2.0f * fabsf(x));
        b->logits[i] = copysignf((1.0f - e) / (1.0f + e), x) * cap;
    }
    return 0;
}

int pagedserve_decode_step(const StepModel *m, const StepBatch *b, int64_t n, int num_threads) {
    if (!m || !b || n < 1) return -1;
    int status = check_batch(m, b, n);
    if (status) return status;
    const int64_t hid = m->hidden, D = m->head_dim, inter = m->intermediate;
    const int64_t qkv = (m->num_heads + 2 * m->num_kv_heads) * D;
    const int64_t widest = 2 * inter > qkv ? 2 * inter : qkv;
    Buffers w = {
        scratch(n * hid), scratch(n * hid), scratch(n * hid), scratch(n * qkv), scratch(n * m->num_heads * D),
        scratch(n * 2 * inter), scratch(n * inter), scratch(n * widest), scratch(D),
    };
    status = w.residual && w.delta && w.h && w.qkv && w.attn && w.gate_up && w.act && w.tmp && w.head
                 ? run_layers(m, b, n, &w, num_threads) : -2;
    free(w.residual); free(w.delta); free(w.h); free(w.qkv); free(w.attn);
    free(w.gate_up); free(w.act); free(w.tmp); free(w.head);
    return status;
}
