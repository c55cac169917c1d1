"""The Python side of kernels/cpu/linear.h: one linear layer as a C function pointer plus the state it reads.

Why a function pointer: the native small-batch step runs a whole layer stack in C, and each weight format (dense,
GGUF blocks, GPTQ/AWQ groups) multiplies in its own kernel. A `LinearMethod` that can run natively hands out a
`NativeLinear`; the step builds the C `ps_linear` structs from them and never dispatches on the format itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.kernels.cpu.structs import PsLinear


# Kernels that read the weights once for up to 8 activation rows (grouped GGUF and GPTQ/AWQ rows) keep the native
# step ahead of the torch path's bf16 GEMMs through 8 sequences with fp32 activations, and through 16 where they
# take int16 activations and AVX512-VNNI dots (kernels/cpu/act_q16.h): measured on SmolLM2 Q4_1, bf16, 2 shared
# cores, the native step ran 1.6-1.7x the torch path's speed at 12 sequences and 1.2-1.3x at 16, against
# 1.05-1.1x and 0.9-1.3x with the fp32 kernel (benchmarks/native_step_crossover.py). Dense weights and the file
# layouts: 2, the default.
GROUPED_NATIVE_MAX_BATCH = 8
VNNI_GROUPED_NATIVE_MAX_BATCH = 16
# GGUF's 4/8-bit tiles (Q4_0, Q4_1, Q8_0: kernels/cpu/packed_grouped.c) in AVX2 builds: with `--dtype auto` the
# native step led the torch path (its panel kernel from 8 rows) at 12 sequences on SmolLM2's Q4_1 (1.45x) and a
# 1B-shaped Llama's Q4_1 and Q8_0 (1.19x, 1.14x), where the limit was chosen, mixed at 16 (1.38x, 0.97x, 1.11x);
# confirmed on the 1B shape's Q4_0 (1.08x at 12). Zen 3, 2 cores, `benchmarks/native_step_crossover.py`
# (docs/benchmarks.md). The GPTQ/AWQ kernel and the K formats keep GROUPED_NATIVE_MAX_BATCH there.
AVX2_PACKED_NATIVE_MAX_BATCH = 12
DEFAULT_NATIVE_MAX_BATCH = 2
# Dense fp32 weights in AVX2 builds without AVX-512, whose torch path multiplies them with kernels/cpu/dense_rows.c
# from 2 rows: the native step (the row-major GEMV) ran ahead at 3 sequences on a 1B-shaped Llama (1.03x; 0.95x at
# 4), where the limit was chosen, and on Gemma 3 270M (1.54x at 3, 1.11x at 6, 0.80x at 8), where it was confirmed
# (Zen 3, 2 cores, `benchmarks/native_step_crossover.py --dtype float32 --torch-limit 1`; the run's SmolLM2 row was
# the embedded GGUF's packed kernels, not fp32 weights). The larger the model, the sooner the GEMM's FMA tiles beat
# the GEMV's reads.
AVX2_DENSE_FP32_NATIVE_MAX_BATCH = 3


def grouped_native_max_batch(isa: str) -> int:
    """The native step's batch limit through a grouped-rows kernel compiled to `isa` (kernels/cpu/packed.py's
    grouped_isa / group_grouped_isa)."""
    return VNNI_GROUPED_NATIVE_MAX_BATCH if isa == "avx512_vnni" else GROUPED_NATIVE_MAX_BATCH


@dataclass(frozen=True, slots=True)
class NativeLinear:
    """fn: address of a `ps_linear_fn`; state: address of what it reads (valid while `keepalive` lives)."""

    fn: int
    state: int
    in_features: int
    out_features: int
    keepalive: tuple[object, ...] = ()
    # Up to this many rows a native step through this kernel beat the torch path's GEMMs where it was measured
    # (benchmarks/native_step_crossover.py); the step's automatic batch limit is the smallest over its linears.
    native_max_batch: int = DEFAULT_NATIVE_MAX_BATCH

    def __post_init__(self) -> None:
        if not self.fn:
            raise ValueError("NativeLinear.fn: a null function pointer")
        if self.native_max_batch < 1:
            raise ValueError(f"NativeLinear.native_max_batch must be >= 1, got {self.native_max_batch}")
        if self.in_features <= 0 or self.out_features <= 0:
            raise ValueError(f"NativeLinear features must be positive, got {self.in_features}x{self.out_features}")

    def as_struct(self) -> PsLinear:
        return PsLinear(self.fn, self.state, self.in_features, self.out_features)
