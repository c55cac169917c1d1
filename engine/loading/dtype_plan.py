"""`--dtype`: what a model computes in, and what its plain matrices are held in.

`auto` picks the fastest correct path for the CPU the kernels build for (engine/host/cpu_features.py: the host's,
or the tier PAGEDSERVE_CPU_ISA / `--cpu-isa` forces):
- native bf16 arithmetic (AMX, AVX512-BF16): bfloat16 throughout, whatever the checkpoint (vLLM's CPU backend
  makes the same choice);
- none (an AVX2 host: Zen 3, Haswell): fp32 compute, where torch would emulate bf16 math through fp32 conversions
  (measured 0.27x llama.cpp at 8 streams on a Zen 3) and fp16 matmuls are slow; a 16-bit checkpoint's matrices
  (and the embedding and head a GPTQ/AWQ checkpoint leaves unquantized: `holding_weights_in`) stay in its dtype,
  widened to fp32 in registers (the native GEMV) or a few MB at a time (prefill), as llama.cpp does: half the
  bytes of fp32 read per token and held in memory, and the products are exactly the fp32 model's;
- GPUs: the checkpoint's dtype.
An explicit dtype is both: `--dtype float32` the reference path (weights expanded at load), `--dtype bfloat16` bf16
throughout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class DtypePlan:
    """compute: activations, norms, the KV cache's `auto`; weights: the plain matrices (linears, token embedding)
    in memory: compute, or a 16-bit checkpoint's own dtype under fp32 compute."""

    compute: torch.dtype
    weights: torch.dtype

    def __post_init__(self) -> None:
        if self.weights != self.compute and not (self.compute == torch.float32 and self.weights in _HALF):
            raise ValueError(f"DtypePlan: {self.weights} weights under {self.compute} compute; only 16-bit weights "
                             "under float32 compute differ")


def checkpoint_dtype(hf_config: dict[str, Any]) -> torch.dtype:
    """config.json's torch_dtype (or dtype); float32 when absent or unknown."""
    name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    return _DTYPES.get(name, torch.float32)


def resolve_dtype(hf_config: dict[str, Any], requested: torch.dtype | None, device: torch.device,
                  cpu_bf16: tuple[str, ...] = ()) -> DtypePlan:
    """`requested` throughout, or `auto`'s choice (module docstring); cpu_bf16: the native-bf16 features of the
    tier the CPU kernels build for (cpu_features.effective_bf16_flags)."""
    if requested is not None:
        return DtypePlan(requested, requested)
    dtype = checkpoint_dtype(hf_config)
    if device.type != "cpu":
        return DtypePlan(dtype, dtype)
    if cpu_bf16:
        logger.info("dtype=auto: computing in bfloat16 (this CPU has native bf16: %s; the checkpoint is %s); "
                    "--dtype float32 gives transformers' fp32 results token for token", ", ".join(cpu_bf16), dtype)
        return DtypePlan(torch.bfloat16, torch.bfloat16)
    if dtype in _HALF:
        logger.info("dtype=auto: checkpoint is %s; computing in float32 (no bf16/fp16 arithmetic on this CPU's "
                    "kernel tier), the weights kept in %s and widened in registers", dtype, dtype)
    return DtypePlan(torch.float32, dtype)
