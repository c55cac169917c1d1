"""ctypes wrappers of layer_ops.c (fused RMSNorm (+ residual add), SiLU-and-mul and RoPE on CPU tensors), and
`NativeLayerOps`, the "native" layer ops built on them.

Each wrapper checks what the C code assumes (CPU, one dtype among fp32/bf16/fp16, dense rows) and allocates the
output.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu.native import COMPUTE_DTYPES, dtype_code, load_library, pool_sleeps
from pagedserve.kernels.layer_ops import LayerOps, TorchLayerOps
from pagedserve.kernels.requirements import Requirements

# fp32 too: its matmuls (oneDNN) already sum in another order than transformers' (MKL), so bit-identity was never
# the guarantee; greedy tokens equal to transformers' are (tests/test_engine_vs_transformers.py), and held with these.
NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True, slots=True)
class SplitThresholds:
    """Elements from which a call is split across torch's threads; below, it runs on the calling thread.

    A parallel region wakes the pool. Measured on a 2-vCPU Zen 4 VM: ~50 us per region when the threads sleep
    between regions (OMP_WAIT_POLICY=PASSIVE), a few us when they spin first (unset, or a GOMP_SPINCOUNT).
    So with sleeping threads only work above ~80 us on one thread is split (bf16 there: RMSNorm ~0.3 ns per
    element, SiLU-and-mul ~0.9 per output, RoPE ~0.5), which keeps decode batches on one thread; with spinning
    threads, from 16k."""

    rms_norm: int
    silu_and_mul: int
    rope: int

    def __post_init__(self) -> None:
        if min(self.rms_norm, self.silu_and_mul, self.rope) < 1:
            raise ValueError(f"split thresholds must be >= 1 element: {self}")

    @staticmethod
    def for_openmp_env(env: Mapping[str, str]) -> "SplitThresholds":
        """env: the OpenMP variables as libgomp read them (OMP_WAIT_POLICY, GOMP_SPINCOUNT; none: spin, then sleep)."""
        if pool_sleeps(env):
            return SplitThresholds(rms_norm=262144, silu_and_mul=131072, rope=163840)
        return SplitThresholds(rms_norm=16384, silu_and_mul=16384, rope=16384)


def _threads(elements: int, threshold: int) -> int:
    return torch.get_num_threads() if elements >= threshold else 1


SPINNING = SplitThresholds.for_openmp_env({})


def _check(x: torch.Tensor, *others: torch.Tensor) -> None:
    assert x.device.type == "cpu" and x.dtype in COMPUTE_DTYPES, f"{x.dtype} on {x.device}"
    for t in others:
        assert t.dtype == x.dtype and t.device.type == "cpu", f"{t.dtype} vs {x.dtype}"


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
    split: SplitThresholds = SPINNING,
) -> torch.Tensor:
    """x [T, hidden] contiguous -> RMSNorm(x). With delta: x <- x + delta in place first (the residual stream),
    and the norm is of that sum."""
    _check(x, weight, *(() if delta is None else (delta,)))
    rows, dim = x.shape
    assert x.is_contiguous() and weight.shape == (dim,) and weight.is_contiguous()
    if delta is not None:
        assert delta.shape == x.shape and delta.is_contiguous()
    out = torch.empty_like(x)
    load_library().pagedserve_rms_norm(
        x.data_ptr(), None if delta is None else delta.data_ptr(), out.data_ptr(), weight.data_ptr(),
        rows, dim, eps, dtype_code(x.dtype), _threads(rows * dim, split.rms_norm),
    )
    return out


def silu_and_mul(gate_up: torch.Tensor, split: SplitThresholds = SPINNING, lib=None) -> torch.Tensor:
    """gate_up [T, 2I] contiguous ([gate | up]) -> silu(gate) * up [T, I]. lib: another build (tests)."""
    _check(gate_up)
    rows, width = gate_up.shape
    assert gate_up.is_contiguous() and width % 2 == 0
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    (lib or load_library()).pagedserve_silu_and_mul(
        gate_up.data_ptr(), out.data_ptr(), rows, width // 2, dtype_code(gate_up.dtype),
        _threads(rows * width // 2, split.silu_and_mul),
    )
    return out


def rope(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, split: SplitThresholds = SPINNING
) -> torch.Tensor:
    """x [T, N, D] (heads dense, rows may be strided) -> x * cos + rotate_half(x) * sin, [T, N, D] contiguous.
    cos, signed_sin: [T, 1, D] contiguous, sin's first half negated (see RopeAngles)."""
    _check(x, cos, signed_sin)
    tokens, heads, dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == dim and dim % 2 == 0
    assert cos.shape == signed_sin.shape == (tokens, 1, dim) and cos.is_contiguous() and signed_sin.is_contiguous()
    out = torch.empty(tokens, heads, dim, dtype=x.dtype)
    load_library().pagedserve_rope(
        x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), out.data_ptr(),
        tokens, heads, dim, dtype_code(x.dtype), _threads(tokens * heads * dim, split.rope),
    )
    return out


class NativeLayerOps(LayerOps):
    """The C kernels for dense CPU tensors in a compute dtype (fp32, bf16, fp16); anything else (odd strides, other
    devices) takes the torch ops."""

    requirements = Requirements(cpu_only=True)

    def __init__(self, split: SplitThresholds | None = None) -> None:
        load_library()  # asked for by name, a missing compiler is an error, not a silent fallback
        self._torch = TorchLayerOps()
        # Read when the engine is built, not at import: libgomp took its wait settings from the same environment.
        self._split = split or SplitThresholds.for_openmp_env(os.environ)

    @staticmethod
    def _native(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in NATIVE_DTYPES

    @classmethod
    def _native_rows(cls, x: torch.Tensor) -> bool:
        """A dense [tokens, width] tensor the row kernels can take as is."""
        return cls._native(x) and x.dim() == 2 and x.is_contiguous()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._native_rows(x):
            return rms_norm(x, weight, eps, split=self._split)
        return self._torch.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._native_rows(residual) and delta.is_contiguous():
            return residual, rms_norm(residual, weight, eps, delta=delta, split=self._split)
        return self._torch.add_rms_norm(residual, delta, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._native_rows(gate_up):
            return silu_and_mul(gate_up, self._split)
        return self._torch.silu_and_mul(gate_up)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        if self._native(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            return rope(x, cos, signed_sin, self._split)
        return self._torch.rope(x, cos, signed_sin)


# A pass over a 49k-token row takes ~10-20 us on one thread: a batch of 8 such rows or more is worth the pool's wake-up.
_MAX_ARGMAX_SPLIT = 262144


def row_max_argmax(logits: torch.Tensor, lib=None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] fp32 on CPU, each row dense -> (each row's maximum, NaN when the row holds a NaN as
    torch's amax gives; the first index holding it, as logits.argmax(dim=-1) picks). lib: another build (tests)."""
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.stride(1) == 1 and vocab > 0
    maxima, index = torch.empty(rows), torch.empty(rows, dtype=torch.long)
    (lib or load_library()).pagedserve_row_max_argmax(
        logits.data_ptr(), rows, vocab, logits.stride(0), maxima.data_ptr(), index.data_ptr(),
        _threads(rows * vocab, _MAX_ARGMAX_SPLIT),
    )
    return maxima, index
