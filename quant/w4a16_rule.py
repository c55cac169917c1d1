"""Which CUDA kernel multiplies a GPTQ/AWQ layer at which row count: the one place the thresholds live.

Set from the H200 runs of tests/gpu/bench_check.py (benchmarks/results/gpu-check-h200-2026-11-28*.json and
gpu-check-h200-2026-11-30*.json: every candidate at M = 1, 16, 512, 2048 on Llama-3-8B-shaped layers, timed as
CUDA-graph replays from HBM):
- Up to `splitk_max_m` (16) rows, any bits and group length: the wide split-K GEMV (w4a16_splitk.py, its launch
  per row count measured there): at M = 1 1.25-1.47x of dense fp16, at 16 0.61-0.72x (two runs), fp16 inputs
  exact and fp32 sums.
- Then below `tinygemm_below_m` rows, 4-bit layers whose groups tinygemm takes (32/64/128/256, the usual
  checkpoints) with bf16 activations go through torch's int4 tinygemm op (0.41-0.49x at M = 16, where the GEMV now
  serves). fp16 activations would be cast to bf16 and back (`tinygemm_fp16`, off): that costs bf16's rounding of
  every activation (3.4e-3 of the largest output on 4096-wide layers, over the fp16 path's 2e-3 bound) for no speed
  over the dense path (0.38-0.41x against 0.36-0.45x at 16 rows).
- Everything else (prefill, and fp16 rows 17-63) dequantizes the weight once into a transient dense tile and
  cuBLAS multiplies: 0.49-0.69x of dense fp16 at M = 512, 0.66-0.91x at 2048 (2026-11-30).
- `gemv_max_m` / `tile_max_m`: the looped GEMV (w4a16_gemv.py) and the split-K tile kernel (w4a16_triton.py) stay
  selectable for rows up to these counts (0: off, as measured: both slower than the paths above).
- `serial_reduce`: their split-K partials summed by the last program of each tile (one launch) rather than by a
  second kernel (measured within 3% of each other).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.quant.base import QuantConfigError

GEMV_MAX_ROWS = 16  # the GEMV's register accumulator holds this many rows (w4a16_gemv.py)
PATHS = ("splitk", "tinygemm", "gemv", "decode", "dense")
SPLITK_MAX_ROWS = 16  # the split-K GEMV's tl.dot tile (w4a16_splitk.py)
# its widest tile (SplitKConfig.block_m), which sizes the shared workspace: 17-64 rows are a bench candidate
SPLITK_WIDEST_ROWS = 64


@dataclass(frozen=True, slots=True)
class W4A16Rule:
    tinygemm_below_m: int = 64
    tinygemm_fp16: bool = False
    gemv_max_m: int = 0
    tile_max_m: int = 0
    splitk_max_m: int = 16
    serial_reduce: bool = False

    def __post_init__(self) -> None:
        if self.tinygemm_below_m < 0:
            raise QuantConfigError("w4a16_rule.tinygemm_below_m", f"{self.tinygemm_below_m} must be >= 0")
        if not 0 <= self.gemv_max_m <= GEMV_MAX_ROWS:
            raise QuantConfigError("w4a16_rule.gemv_max_m", f"{self.gemv_max_m} must be in 0..{GEMV_MAX_ROWS}")
        if not 0 <= self.splitk_max_m <= SPLITK_MAX_ROWS:
            raise QuantConfigError("w4a16_rule.splitk_max_m", f"{self.splitk_max_m} must be in 0..{SPLITK_MAX_ROWS}")
        if self.tile_max_m < 0:
            raise QuantConfigError("w4a16_rule.tile_max_m", f"{self.tile_max_m} must be >= 0")

    def path(self, m: int, dtype: torch.dtype, tinygemm_fits: bool) -> str:
        """The path for M rows of `dtype` activations: one of PATHS."""
        if m <= self.splitk_max_m:
            return "splitk"
        tinygemm_dtype = dtype == torch.bfloat16 or (dtype == torch.float16 and self.tinygemm_fp16)
        if tinygemm_fits and tinygemm_dtype and m < self.tinygemm_below_m:
            return "tinygemm"
        if m <= self.gemv_max_m:
            return "gemv"
        return "decode" if m <= self.tile_max_m else "dense"


RULE = W4A16Rule()

