"""Which CUDA kernel multiplies a GPTQ/AWQ layer at which row count: the one place the thresholds live.

Set from the H200 runs of tests/gpu/bench_check.py (benchmarks/results/gpu-check-h200-2026-11-28*.json, every
candidate at M = 1, 16, 512, 2048 on Llama-3-8B-shaped layers, timed as CUDA-graph replays from HBM):
- Below `tinygemm_below_m` rows, 4-bit layers whose groups tinygemm takes (32/64/128/256, the usual checkpoints) go
  through torch's int4 tinygemm op: at M = 1 0.97-1.72x of dense fp16 on bf16 activations (1.25-1.27x on the
  4096 x 14336 shapes) and 0.68-1.28x on fp16 ones (cast to bf16 and back, `tinygemm_fp16`), against at best
  0.36-0.42x for everything written here on act-order GPTQ; at M = 16 0.42-0.49x against 0.36-0.45x.
- Everything else (8-bit, other group lengths, fp32 activations, prefill) dequantizes the weight once into a transient
  dense tile and cuBLAS multiplies: 0.53-0.71x of dense fp16 at M = 512, 0.69-0.86x at 2048; at M = 1 it also beat the
  split-K tile kernel (0.36-0.42x against 0.20-0.25x) and tied it at M = 16.
- `gemv_max_m` / `tile_max_m`: the GEMV (w4a16_gemv.py) and the split-K tile kernel (w4a16_triton.py) stay
  selectable for rows up to these counts (0: off, as measured: both slower than the paths above).
- `splitk_max_m`: the wide split-K GEMV (w4a16_splitk.py) serves up to this many rows, before tinygemm is
  considered (0: off until a device run has measured it); `splitk_reduce` says how its partial
  sums meet ("last" or "atomic").
- `serial_reduce`: their split-K partials summed by the last program of each tile (one launch) rather than by a
  second kernel (measured within 3% of each other).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pagedserve.quant.base import QuantConfigError

GEMV_MAX_ROWS = 16  # the GEMV's register accumulator holds this many rows (w4a16_gemv.py)
PATHS = ("splitk", "tinygemm", "gemv", "decode", "dense")
SPLITK_MAX_ROWS = 16  # the split-K GEMV's tl.dot tile (w4a16_splitk.py)


@dataclass(frozen=True, slots=True)
class W4A16Rule:
    tinygemm_below_m: int = 64
    tinygemm_fp16: bool = True
    gemv_max_m: int = 0
    tile_max_m: int = 0
    splitk_max_m: int = 0
    splitk_reduce: str = "last"
    serial_reduce: bool = False

    def __post_init__(self) -> None:
        if self.tinygemm_below_m < 0:
            raise QuantConfigError("w4a16_rule.tinygemm_below_m", f"{self.tinygemm_below_m} must be >= 0")
        if not 0 <= self.gemv_max_m <= GEMV_MAX_ROWS:
            raise QuantConfigError("w4a16_rule.gemv_max_m", f"{self.gemv_max_m} must be in 0..{GEMV_MAX_ROWS}")
        if not 0 <= self.splitk_max_m <= SPLITK_MAX_ROWS:
            raise QuantConfigError("w4a16_rule.splitk_max_m", f"{self.splitk_max_m} must be in 0..{SPLITK_MAX_ROWS}")
        if self.splitk_reduce not in ("last", "atomic"):
            raise QuantConfigError("w4a16_rule.splitk_reduce", f"{self.splitk_reduce!r} is not 'last' or 'atomic'")
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


@contextmanager
def rule_in_effect(rule: W4A16Rule) -> Iterator[W4A16Rule]:
    """Layers built and run inside the block follow `rule` (the device checks compare rules in one process)."""
    global RULE
    saved, RULE = RULE, rule
    try:
        yield rule
    finally:
        RULE = saved
