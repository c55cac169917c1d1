"""The Python side of kernels/cpu_linear.h: one linear layer as a C function pointer plus the state it reads.

Why a function pointer: the native small-batch step runs a whole layer stack in C, and each weight format (dense,
GGUF blocks, GPTQ/AWQ groups) multiplies in its own kernel. A `LinearMethod` that can run natively hands out a
`NativeLinear`; the step builds the C `ps_linear` structs from them and never dispatches on the format itself.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass


# Kernels that read the weights once for up to 8 activation rows (grouped GGUF and GPTQ/AWQ rows) keep the native
# step ahead of the torch path's bf16 GEMMs through 8 sequences (benchmarks/native_step_crossover.py; dense
# weights and the file layouts: 2, the default).
GROUPED_NATIVE_MAX_BATCH = 8
DEFAULT_NATIVE_MAX_BATCH = 2


class PsLinear(ctypes.Structure):
    # Field order and types mirror ps_linear in kernels/cpu_linear.h.
    _fields_ = [("fn", ctypes.c_void_p), ("state", ctypes.c_void_p),
                ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64)]


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
