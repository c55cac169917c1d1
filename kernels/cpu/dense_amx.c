/* The grouped bf16 layout (dense_grouped.c) on AMX tiles: tdpbf16ps reads a B tile as 16 rows of 64 bytes, row k
 * holding, for 16 output columns, the bf16 pair of inputs 2k, 2k + 1. A group's 16 consecutive 64-byte input-pair
 * tiles are exactly that, so one tileloadd (stride 64) takes 32 inputs x 16 outputs straight from the weight the
 * GEMV reads: no repacking per call and no second copy. A tile is 16 activation rows x 32 bf16 inputs.
 *
 * Blocking: each thread owns a contiguous run of group pairs; activation rows go in blocks of about 512 KB of
 * packed x (dense_gemm.c packs it in 1 KB tiles; the block stays in L2), inputs in blocks of 2048 (64 steps),
 * and the thread's pairs in blocks of about 512 KB of panels (in L2 beside the rows). Within those, a pair of row
 * tiles (32 rows, in L1) meets every pair of groups of the weight block in turn, so the output is written 32 rows x
 * the block's columns at a time: a 2048-row prefill of a wide layer otherwise wrote 16 columns down every row,
 * one page per row (a TLB miss per row: 0.68x of the blocked rate on a 3072 x 576 layer, single thread, noisy).
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

/* A_BLOCK_BYTES: packed x per row block (kept in L2); K_BLOCK_STEPS: 32-input steps per input block, so a row
 * block is 256 rows whatever the width and each weight panel is read from memory once per 256 rows. */
enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18, A_BLOCK_BYTES = 1 << 19, B_BLOCK_BYTES = 1 << 19,
       K_BLOCK_STEPS = 64 };

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

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
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
}

/* C tiles 0-3 (rows a0/a1 x groups b0/b1) over `steps` 32-input steps; a1 == a0 or b1 == b0 at the edges (their
 * duplicate results are not stored). */
INLINE void steps_2x2(const uint32_t *a0, const uint32_t *a1, const uint32_t *b0, const uint32_t *b1,
                      int64_t steps) {
    for (int64_t k = 0; k < steps; k++) {
        _tile_loadd(4, a0 + 256 * k, 64);
        _tile_loadd(6, b0 + 256 * k, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b1 + 256 * k, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a1 + 256 * k, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

typedef struct {
    const DenseLinear *s;
    const uint32_t *xp;
    int64_t ksteps, rows;
    void *y;
    int y_dtype;
} AmxCall;

/* Groups g, g2 (g2 == g: one group) x row tiles mt, mt2 (mt2 == mt: one) over input steps [k0, k1): the sums so
 * far come from `partial` (none before step 0) and go back to it, or after the last step to y. `tails`: each
 * group's last partial step, zero-padded (in % 32 != 0), or NULL. Loading and storing fp32 tiles is exact, so the
 * input blocks change no bit of a sum. */
static void amx_block(const AmxCall *c, int64_t g, int64_t g2, int64_t mt, int64_t mt2, int64_t k0, int64_t k1,
                      const uint32_t *tails, float *partial, float *out) {
    const DenseLinear *s = c->s;
    const int64_t pairs = s->in_features / 2, gwords = pairs * DENSE_GROUP_ROWS, full = pairs / 16;
    const uint32_t *w = s->weight;
    const uint32_t *a0 = c->xp + mt * c->ksteps * 256, *a1 = c->xp + mt2 * c->ksteps * 256;
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
    if (kf > k0) steps_2x2(a0 + 256 * k0, a1 + 256 * k0, w + g * gwords + 256 * k0, w + g2 * gwords + 256 * k0, kf - k0);
    if (tails && k1 > full) steps_2x2(a0 + 256 * full, a1 + 256 * full, tails, tails + 256, 1);
    float *to = k1 < c->ksteps ? partial : out;
    _tile_stored(0, to, 64);
    _tile_stored(1, to + 256, 64);
    _tile_stored(2, to + 512, 64);
    _tile_stored(3, to + 768, 64);
    if (to == partial) return;
    for (int i = 0; i < 2; i++) {
        if (i == 1 && mt2 == mt) break;
        const int64_t r0 = (i ? mt2 : mt) * 16, n = c->rows - r0 < 16 ? c->rows - r0 : 16;
        ps_dense_emit(s, out + 512 * i, r0, n, g * 16, c->y, c->y_dtype);
        if (g2 != g) ps_dense_emit(s, out + 512 * i + 256, r0, n, g2 * 16, c->y, c->y_dtype);
    }
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

int ps_dense_amx(const DenseLinear *s, const uint32_t *xp, int64_t rows, void *y, int y_dtype) {
    if (!ps_amx_ready()) return 1;
    const int64_t ksteps = (s->in_features / 2 + 15) / 16, full = s->in_features / 2 / 16;
    const AmxCall call = {s, xp, ksteps, rows, y, y_dtype};
    const int64_t groups = s->out_features / DENSE_GROUP_ROWS, units = (groups + 1) / 2;
    const int64_t mtiles = (rows + 15) / 16, has_tail = ksteps > full;
    const int64_t kblock = ksteps < K_BLOCK_STEPS ? ksteps : K_BLOCK_STEPS;
    int64_t block = A_BLOCK_BYTES / (kblock * 1024);  /* row tiles per block: its input block's x fits in L2 */
    block = block < 2 ? 2 : block & ~(int64_t)1;
    int64_t ublock = B_BLOCK_BYTES / (kblock * 2048);  /* group pairs per weight block: its panels fit in L2 */
    ublock = ublock < 1 ? 1 : ublock;
    float *partials = NULL;  /* per (unit, pair of row tiles): 4 fp32 tiles between input blocks */
    if (ksteps > kblock && !(partials = aligned_alloc(64, (size_t)units * (block / 2) * 4096))) return -2;
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
        float out[4 * 256] __attribute__((aligned(64)));
        uint32_t tails[512] __attribute__((aligned(64)));
        configure_tiles();
        for (int64_t m0 = 0; m0 < mtiles; m0 += block) {
            const int64_t m1 = m0 + block < mtiles ? m0 + block : mtiles;
            for (int64_t k0 = 0; k0 < ksteps; k0 += kblock) {
                const int64_t k1 = k0 + kblock < ksteps ? k0 + kblock : ksteps;
                for (int64_t ub = u0; ub < u1; ub += ublock)
                    for (int64_t mt = m0; mt < m1; mt += 2)
                        for (int64_t u = ub; u < u1 && u < ub + ublock; u++) {
                            const int64_t g = 2 * u, g2 = g + 1 < groups ? g + 1 : g;
                            if (has_tail && k1 > full) load_tails(s, g, g2, tails);
                            amx_block(&call, g, g2, mt, mt + 1 < m1 ? mt + 1 : mt, k0, k1, has_tail ? tails : NULL,
                                      partials ? partials + (u * (block / 2) + (mt - m0) / 2) * 1024 : NULL, out);
                        }
            }
        }
        _tile_release();
    }
    free(partials);
    return 0;
}
#else
int ps_amx_ready(void) { return 0; }

int ps_dense_amx(const DenseLinear *s, const uint32_t *xp, int64_t rows, void *y, int y_dtype) {
    (void)s, (void)xp, (void)rows, (void)y, (void)y_dtype;
    return 1;
}
#endif
