/* The grouped bf16 layout (dense_grouped.c) on AMX tiles: tdpbf16ps reads a B tile as 16 rows of 64 bytes, row k
 * holding, for 16 output columns, the bf16 pair of inputs 2k, 2k + 1. A group's 16 consecutive 64-byte input-pair
 * tiles are exactly that, so one tileloadd (stride 64) takes 32 inputs x 16 outputs straight from the weight the
 * GEMV reads: no repacking per call and no second copy. A tile is 16 activation rows x 32 bf16 inputs.
 *
 * x: bf16 rows read in place (tileloadd with x's row stride; only a partial last row tile is copied, zero-padded)
 * or, for fp32 x, inputs not a multiple of 32 or rows 4 KB apart, packed by dense_gemm.c in 1 KB tiles.
 * Blocking: each thread owns a contiguous run of group pairs, in blocks of about 512 KB of panels (kept in L2);
 * activation rows go in blocks of about 512 KB of x (in L2 beside them), inputs in blocks of at most 20 steps once
 * there is more than one pair of row tiles, so that a pair of row tiles (32 rows, up to 40 KB) stays in L1 while the
 * weight block's panels stream past it from L2 (loaded with tileloaddt1, which keeps them out of L1). A pair of row
 * tiles meets every group pair of the weight block in turn, so the output is written 32 rows x the block's columns
 * at a time: a 2048-row prefill of a wide layer otherwise wrote 16 columns down every row, one page per row (a TLB
 * miss per row: 0.68x of the blocked rate on a 3072 x 576 layer, single thread, noisy). Each block's sums reach y
 * while the next block multiplies (see Pending), and while a block's first row pair multiplies the next group
 * pair's panels are prefetched into L2 (a layer's weights come from L3 or memory at each call in a model).
 * 2 x 2 tiles of 32 rows x 32 outputs accumulate in the tile registers, carried in fp32 between input blocks.
 * Every output is one sum over the input tiles in order, whatever the number of rows (a row's result does not
 * depend on the rows beside it). Products of bf16 pairs are summed in fp32 by the hardware (its own order within a tile).
 */
#include "isa.h"
#include "dense_linear.h"
#include "native.h"

#if defined(PS_AMX)
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

/* A_BLOCK_BYTES: packed x per row block (kept in L2). K_BLOCK_MAX: 32-input steps per input block at most: a
 * pair of row tiles' block (up to 40 KB) then stays in L1 while the weight streams past it from L2. */
enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18, A_BLOCK_BYTES = 1 << 19, B_BLOCK_BYTES = 1 << 19,
       K_BLOCK_MAX = 20, PREFETCH_MIN_BYTES = 4 << 20 };

static int amx_state;  /* 0: not asked yet; 1: granted; -1: refused */

/* Linux hands a process the 8 KB tile state only after it asks; some VMs list AMX in cpuid and refuse. */
int ps_amx_ready(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state == 0) {
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state == 1;
}

static void configure_tiles(void) {
    const TileConfig config = ps_amx_full_tiles();
    _tile_loadconfig(&config);
}

/* Where x's tiles are: tile (row tile mt, input step k) at a + mt * a_tile + k * a_step (32-bit words), its rows
 * `lda` bytes apart; row tiles from `tail_from` on at `tail` instead (the last, zero-padded, when x is read as it
 * is). */
typedef struct {
    const DenseLinear *s;
    const uint32_t *a, *tail;
    int64_t a_tile, a_step, lda, tail_from, ksteps, rows;
    void *y;
    int y_dtype;
} AmxCall;

INLINE const uint32_t *a_tiles(const AmxCall *c, int64_t mt) {
    return mt >= c->tail_from ? c->tail : c->a + mt * c->a_tile;
}

/* A finished block's sums (4 fp32 tiles in `c`: rows r0.. of tile 0 then tile 1, groups g, g2 side by side) not yet
 * written to y: the next block writes them a few rows per input step, so the vector unit converts them while the
 * tile unit multiplies (written after the block, they had cost 20-30% of a 2048-row call). */
typedef struct {
    const float *c;
    int64_t r0, col0;
    int rows, done, wide;  /* rows to write, rows written, 2 when g2 != g */
} Pending;

INLINE void emit_rows(const AmxCall *c, Pending *p, int upto) {
    const DenseLinear *s = c->s;
    const int64_t out = s->out_features, esize = elem_size(c->y_dtype);
    for (; p->done < p->rows && p->done < upto; p->done++) {
        const int r = p->done;
        char *y = (char *)c->y + ((p->r0 + r) * out + p->col0) * esize;
        for (int h = 0; h < p->wide; h++) {
            f32x16 v;
            memcpy(&v, p->c + 512 * (r / 16) + 256 * h + 16 * (r % 16), sizeof v);
            if (s->bias) v += load16((const char *)s->bias + (p->col0 + 16 * h) * elem_size(s->bias_dtype), 0,
                                     s->bias_dtype);
            store16(y, h, c->y_dtype, v);
        }
    }
}

/* C tiles 0-3 (rows a0/a1 x groups b0/b1) over `steps` 32-input steps; a1 == a0 or b1 == b0 at the edges (their
 * duplicate results are not stored). The weight is loaded with the streaming hint (tileloaddt1): it passes once
 * per row pair, and kept out of L1 it leaves the row pair's tiles there (1.1-1.3x at 2048 rows, one thread). */
INLINE void steps_2x2(const uint32_t *a0, const uint32_t *a1, const uint32_t *b0, const uint32_t *b1,
                      int64_t steps, const AmxCall *c, Pending *p, const char *ahead) {
    const int64_t as = c->a_step, lda = c->lda;
    for (int64_t k = 0; k < steps; k++) {
        if (ahead)  /* the next group pair's tiles of this step, into L2 */
            for (int l = 0; l < 1024; l += 64) {
                _mm_prefetch(ahead + 1024 * k + l, _MM_HINT_T1);
                _mm_prefetch(ahead + 32 * c->s->in_features + 1024 * k + l, _MM_HINT_T1);
            }
        _tile_loadd(4, a0 + as * k, lda);
        _tile_stream_loadd(6, b0 + 256 * k, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_stream_loadd(7, b1 + 256 * k, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a1 + as * k, lda);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        emit_rows(c, p, 2 * (int)k + 2);
    }
}

/* Groups g, g2 (g2 == g: one group) x row tiles mt, mt2 (mt2 == mt: one) over input steps [k0, k1): the sums so
 * far come from `partial` (none before step 0) and go back to it, or after the last step to `out`, which becomes
 * the pending block (`p`'s own buffer is written first). `tails`: each group's last partial step, zero-padded
 * (in % 32 != 0), or NULL. Loading and storing fp32 tiles is exact, so the input blocks change no bit of a sum. */
static void amx_block(const AmxCall *c, int64_t g, int64_t g2, int64_t mt, int64_t mt2, int64_t k0, int64_t k1,
                      const uint32_t *tails, float *partial, float *out, Pending *p, int ahead) {
    const DenseLinear *s = c->s;
    const int64_t pairs = s->in_features / 2, gwords = pairs * DENSE_GROUP_ROWS, full = pairs / 16;
    const uint32_t *w = s->weight;
    const uint32_t *a0 = a_tiles(c, mt) + k0 * c->a_step, *a1 = a_tiles(c, mt2) + k0 * c->a_step;
    if (k0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, partial, 64);
        _tile_loadd(1, partial + 256, 64);
        _tile_loadd(2, partial + 512, 64);
        _tile_loadd(3, partial + 768, 64);
    }
    const int64_t kf = k1 < full ? k1 : full;
    if (kf > k0)
        steps_2x2(a0, a1, w + g * gwords + 256 * k0, w + g2 * gwords + 256 * k0, kf - k0, c, p,
                  ahead && g + 3 < s->out_features / 16 ? (const char *)(w + (g + 2) * gwords + 256 * k0) : NULL);
    if (tails && k1 > full)
        steps_2x2(a0 + (full - k0) * c->a_step, a1 + (full - k0) * c->a_step, tails, tails + 256, 1, c, p, NULL);
    emit_rows(c, p, 32);
    float *to = k1 < c->ksteps ? partial : out;
    _tile_stored(0, to, 64);
    _tile_stored(1, to + 256, 64);
    _tile_stored(2, to + 512, 64);
    _tile_stored(3, to + 768, 64);
    if (to == partial) return;
    const int64_t r0 = mt * 16, left = c->rows - r0, most = mt2 == mt ? 16 : 32;
    *p = (Pending){out, r0, g * 16, (int)(left < most ? left : most), 0, g2 == g ? 1 : 2};
}

/* Copies groups g, g2's last partial input step into `tails` (two 1 KB tiles, zero beyond the input). */
static void load_tails(const DenseLinear *s, int64_t g, int64_t g2, uint32_t *tails) {
    const int64_t pairs = s->in_features / 2, gwords = pairs * DENSE_GROUP_ROWS, full = pairs / 16;
    const int64_t rest = (pairs - 16 * full) * DENSE_GROUP_ROWS;
    const uint32_t *w = s->weight;
    memset(tails, 0, 512 * sizeof *tails);
    memcpy(tails, w + g * gwords + full * 256, rest * sizeof *tails);
    memcpy(tails + 256, w + g2 * gwords + full * 256, rest * sizeof *tails);
}

static int amx_run(const AmxCall *c) {
    const DenseLinear *s = c->s;
    const int64_t ksteps = c->ksteps, full = s->in_features / 2 / 16, rows = c->rows;
    const int64_t groups = s->out_features / DENSE_GROUP_ROWS, units = (groups + 1) / 2;
    const int64_t mtiles = (rows + 15) / 16, has_tail = ksteps > full;
    /* one pair of row tiles: the weight streams from memory once whatever the blocks; input blocks only add trips */
    const int64_t kblocks = mtiles <= 2 ? 1 : (ksteps + K_BLOCK_MAX - 1) / K_BLOCK_MAX;
    const int64_t kblock = (ksteps + kblocks - 1) / kblocks;
    int64_t block = A_BLOCK_BYTES / (kblock * 1024);  /* row tiles per block: its input block's x fits in L2 */
    block = block < 2 ? 2 : block & ~(int64_t)1;
    int64_t ublock = B_BLOCK_BYTES / (kblock * 2048);  /* group pairs per weight block: its panels fit in L2 */
    ublock = ublock < 1 ? 1 : ublock;
    /* Prefetching costs fill buffers the tile loads want; it pays only on a weight that cannot stay in L2. */
    const int wide = s->out_features * s->in_features * 2 >= PREFETCH_MIN_BYTES;
    /* per thread, per (group pair of the weight block, pair of row tiles): 4 fp32 tiles between input blocks */
    const int64_t pairs_used = (mtiles + 1) / 2 < block / 2 ? (mtiles + 1) / 2 : block / 2;
    const int64_t per_thread = (ublock < units ? ublock : units) * pairs_used * 1024;
    float *partials = NULL;
    if (ksteps > kblock && !(partials = aligned_alloc(64, (size_t)omp_get_max_threads() * per_thread * 4))) return -2;
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
        float out[2][4 * 256] __attribute__((aligned(64)));  /* the pending block's and the next one's */
        float *mine = partials ? partials + t * per_thread : NULL;
        Pending pending = {out[1], 0, 0, 0, 0, 1};
        int next = 0;
        uint32_t tails[512] __attribute__((aligned(64)));
        /* blocks of equal size: a last block of a few units or row tiles would reuse its tiles a few times only */
        const int64_t nub = (u1 - u0 + ublock - 1) / ublock, ubsize = nub ? (u1 - u0 + nub - 1) / nub : 1;
        const int64_t nmb = (mtiles + block - 1) / block, msize = ((mtiles + nmb - 1) / nmb + 1) & ~(int64_t)1;
        configure_tiles();
        for (int64_t m0 = 0; m0 < mtiles; m0 += msize) {
            const int64_t m1 = m0 + msize < mtiles ? m0 + msize : mtiles;
            for (int64_t ub = u0; ub < u1; ub += ubsize)
                for (int64_t k0 = 0; k0 < ksteps; k0 += kblock) {
                    const int64_t k1 = k0 + kblock < ksteps ? k0 + kblock : ksteps;
                    for (int64_t mt = m0; mt < m1; mt += 2)
                        for (int64_t u = ub; u < u1 && u < ub + ubsize; u++) {
                            const int64_t g = 2 * u, g2 = g + 1 < groups ? g + 1 : g;
                            if (has_tail && k1 > full) load_tails(s, g, g2, tails);
                            amx_block(c, g, g2, mt, mt + 1 < m1 ? mt + 1 : mt, k0, k1, has_tail ? tails : NULL,
                                      mine ? mine + ((u - ub) * pairs_used + (mt - m0) / 2) * 1024 : NULL,
                                      out[next], &pending, mt == m0 && wide);
                            if (pending.c == out[next]) next ^= 1;
                        }
                }
        }
        emit_rows(c, &pending, 32);
        _tile_release();
    }
    free(partials);
    return 0;
}

int ps_dense_amx(const DenseLinear *s, const uint32_t *xp, int64_t rows, void *y, int y_dtype) {
    if (!ps_amx_ready()) return 1;
    const int64_t ksteps = (s->in_features / 2 + 15) / 16;
    const AmxCall call = {s, xp, NULL, ksteps * 256, 256, 64, INT64_MAX, ksteps, rows, y, y_dtype};
    return amx_run(&call);
}

/* Rows of x `stride` bytes apart that meet in one L1 set (4 KB apart, 12 ways) at most this many per pair of row
 * tiles: past it, a tile pair's rows evict each other and x is packed instead. */
enum { SET_SHARERS_MAX = 8 };

int ps_dense_amx_rows(const DenseLinear *s, const uint16_t *x, int64_t rows, void *y, int y_dtype) {
    const int64_t in = s->in_features, stride = 2 * in;
    int64_t a = stride, b = 4096;
    while (b) { const int64_t t = a % b; a = b, b = t; }
    const int64_t period = 4096 / a;  /* rows r and r + period share their L1 set */
    if (!ps_amx_ready() || in % 32 || 2 * ((16 + period - 1) / period) > SET_SHARERS_MAX) return 1;
    const int64_t tail_from = rows / 16, left = rows - 16 * tail_from;
    uint16_t *tail = NULL;
    if (left && !(tail = aligned_alloc(64, (size_t)(16 * stride)))) return -2;
    if (tail) {
        memcpy(tail, x + tail_from * 16 * in, (size_t)(left * stride));
        memset(tail + left * in, 0, (size_t)((16 - left) * stride));
    }
    const AmxCall call = {s, (const uint32_t *)x, (const uint32_t *)tail, 8 * in, 16, stride,
                          tail ? tail_from : INT64_MAX, in / 32, rows, y, y_dtype};
    const int status = amx_run(&call);
    free(tail);
    return status;
}
#else
int ps_amx_ready(void) { return 0; }

int ps_dense_amx(const DenseLinear *s, const uint32_t *xp, int64_t rows, void *y, int y_dtype) {
    (void)s, (void)xp, (void)rows, (void)y, (void)y_dtype;
    return 1;
}

int ps_dense_amx_rows(const DenseLinear *s, const uint16_t *x, int64_t rows, void *y, int y_dtype) {
    (void)s, (void)x, (void)rows, (void)y, (void)y_dtype;
    return 1;
}
#endif
