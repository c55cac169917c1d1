/* The one place pagedserve's C kernels learn which instructions they may use. Every file tests these macros, never
 * the compiler's own __AVX*__ ones, so a tier means the same in every kernel; kernels/cpu/isa.py names the tiers,
 * finds the host's, and builds a forced one with exactly its flags (PAGEDSERVE_CPU_ISA), so the code of a higher
 * tier is not even compiled into a lower tier's object.
 *
 *   PS_AVX2         AVX2 + FMA + F16C                         tier "avx2" (Haswell, Zen 1-3)
 *   PS_AVX2_VNNI    PS_AVX2 + AVX-VNNI (VEX vpdpbusd)         tier "avx2_vnni" (Alder Lake, Sapphire Rapids)
 *   PS_AVX512       PS_AVX2 + AVX-512 F, BW, DQ, VL           tier "avx512" (Skylake-SP)
 *   PS_AVX512_VNNI  PS_AVX512 + AVX512-VNNI + AVX512-VBMI     tier "avx512_vnni" (Ice Lake, Zen 4)
 *   PS_AVX512_BF16  PS_AVX512_VNNI + AVX512-BF16              tier "avx512_bf16" (Sapphire Rapids, Zen 4)
 *   PS_AMX          PS_AVX512_BF16 + AMX-TILE + AMX-BF16      native builds only (see below)
 *
 * The tiers are not one chain: Zen 4 has the AVX-512 ones but not AVX-VNNI. PS_ISA_TIER names the highest tier the
 * build's flags reach; pagedserve_isa_tier() (isa.c) returns it at run time. */
#ifndef PAGEDSERVE_CPU_ISA_H
#define PAGEDSERVE_CPU_ISA_H

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PS_AVX2 1
#endif
#if defined(PS_AVX2) && defined(__AVXVNNI__)
#define PS_AVX2_VNNI 1
#endif
#if defined(PS_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define PS_AVX512 1
#endif
#if defined(PS_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define PS_AVX512_VNNI 1
#endif
#if defined(PS_AVX512_VNNI) && defined(__AVX512BF16__)
#define PS_AVX512_BF16 1
#endif
/* 256-bit vectors only (AVX2 without AVX-512): a 16-lane vector is two ymm halves, and gcc 12 lowers 16-lane
 * comparisons, fp16 conversions, 32-lane shuffles and wide accumulator arrays badly there (lanes.h, kv_values.h,
 * kv_dot.h spell those out per half). */
#if defined(PS_AVX2) && !defined(PS_AVX512)
#define PS_AVX2_ONLY 1
#endif

/* AMX tiles (tdpbf16ps) are no tier of their own: only a -march=native build on a CPU listing AMX-TILE and AMX-BF16
 * compiles them (no forced tier's flags name them, so PAGEDSERVE_CPU_ISA turns AMX off), and even then the kernel
 * asks the OS for the tile state at run time and keeps to AVX512-BF16 code where it is refused (dense_amx.c). */
#if defined(PS_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PS_AMX 1
#endif

#if defined(PS_AVX512_BF16)
#define PS_ISA_TIER "avx512_bf16"
#elif defined(PS_AVX512_VNNI)
#define PS_ISA_TIER "avx512_vnni"
#elif defined(PS_AVX512)
#define PS_ISA_TIER "avx512"
#elif defined(PS_AVX2_VNNI)
#define PS_ISA_TIER "avx2_vnni"
#elif defined(PS_AVX2)
#define PS_ISA_TIER "avx2"
#else
#define PS_ISA_TIER "portable"
#endif

#if defined(PS_AVX2)
#include <immintrin.h>

/* The sum of 8 fp32 lanes, one fixed order (halves, pairs, then the last two) for every kernel that ends in one. */
static inline float ps_hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* acc + the pairwise int16 products of a and b, summed per int32 lane: exact, whichever instruction. */
static inline __m256i ps_dpwssd8(__m256i acc, __m256i a, __m256i b) {
#if defined(PS_AVX2_VNNI)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
#endif

#include <stddef.h>

/* Exported for kernels/cpu/build.py: the C size of each structure a ctypes class mirrors, checked at load. */
#define PS_SIZEOF(name, type) \
    __attribute__((visibility("default"))) size_t ps_sizeof_##name(void) { return sizeof(type); }

#endif
