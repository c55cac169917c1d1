"""Which CUDA kernel multiplies a GPTQ/AWQ layer at which row count: the one place the thresholds live.

- Up to `gemv_max_m` rows the GEMV of w4a16_gemv.py (a register accumulator per K split, codes made floats without
  a conversion instruction); up to `dense_from_m` the split-K tile kernel of w4a16_triton.py (tensor cores).
- Below `dense_from_m` rows (decode, small batches) the packed weight is read once by a decode kernel: reading it is
  what the step is bound by, so 4-bit should approach 4x fewer bytes than fp16.
- From `dense_from_m` rows the `w4a16` kernel dequantizes the weight once into a transient dense tile and cuBLAS
  multiplies: a prompt's GEMM is compute-bound and tensor-core GEMMs beat any fused dequant loop written here
  (0.79-0.85x of dense fp16 at M = 2048 on H100/H200, docs/gpu.md).
- `four_bit` names the decode kernel the auto choice tries first for 4-bit layers: "w4a16" (the Triton kernel of
  w4a16_triton.py, any bits, exact fp16/fp32 scales) or "tinygemm" (torch's int4 op: bf16 scales and activations,
  and every row count through it since it keeps no other copy of the weight). 8-bit layers and layouts tinygemm
  refuses use w4a16.
- `tinygemm_fp16`: whether tinygemm may serve fp16 models (activations cast to bf16 and back).
- `serial_reduce`: the decode kernel's split-K partials summed by the last program of each tile (one launch, a
  per-layer counter per tile) rather than by a second small kernel. Off until the device run shows it correct and
  faster (bench candidate `w4a16_decode_serial`, test_w4a16_gpu.py).

The values below are the starting point before a device run has measured the candidates (tests/gpu/bench_check.py
prints every candidate at every size); docs/gpu.md says which are confirmed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.quant.base import QuantConfigError

DECODE_KERNELS = ("w4a16", "tinygemm")
GEMV_MAX_ROWS = 16  # the GEMV's register accumulator holds this many rows (w4a16_gemv.py)


@dataclass(frozen=True, slots=True)
class W4A16Rule:
    gemv_max_m: int = 16
    dense_from_m: int = 64
    four_bit: str = "w4a16"
    tinygemm_fp16: bool = False
    serial_reduce: bool = False

    def __post_init__(self) -> None:
        if self.dense_from_m < 1:
            raise QuantConfigError("w4a16_rule.dense_from_m", f"{self.dense_from_m} must be >= 1")
        if not 0 <= self.gemv_max_m <= GEMV_MAX_ROWS:
            raise QuantConfigError("w4a16_rule.gemv_max_m", f"{self.gemv_max_m} must be in 0..{GEMV_MAX_ROWS}")
        if self.four_bit not in DECODE_KERNELS:
            raise QuantConfigError("w4a16_rule.four_bit",
                                   f"{self.four_bit!r} is not supported; supported: {list(DECODE_KERNELS)}")

    def path(self, m: int) -> str:
        """The w4a16 kernel's path for M rows: "gemv", "decode" (the split-K tile kernel) or "dense"."""
        if m <= self.gemv_max_m:
            return "gemv"
        return "dense" if m >= self.dense_from_m else "decode"

    def cuda_order(self, dtype: torch.dtype) -> tuple[str, ...]:
        """Kernel names in the order the auto choice tries them for a layer computing in `dtype`."""
        first = self.four_bit
        if first == "tinygemm" and dtype == torch.float16 and not self.tinygemm_fp16:
            first = "w4a16"
        return tuple(dict.fromkeys((first, "w4a16")))


RULE = W4A16Rule()
