"""An unquantized LM head served from Q8_0 blocks made at load (`EngineConfig.lm_head_quantization = "q8_0"`).

Why: GPTQ/AWQ exports of tied models (SmolLM2, Gemma 3, Qwen2 small sizes) keep the head in 16 bits, and no AWQ
tool quantizes it: there the head is the largest single read of a decode step (SmolLM2-135M: 56.6 MB of 113 MB per
token), where a GGUF file holds it in Q8_0 (30.1 MB), as llama.cpp's converter writes it. Opt-in, because it changes
the checkpoint's numerics: each 32-weight block rounded to int8 with one fp16 scale (gguf's own quantizer, so the
blocks are what a GGUF file would hold). Only the head's matmul reads the blocks: token lookups keep reading the
embedding as stored, and batches past the packed kernel's rows multiply the blocks expanded once (the GGUF
`auto` mode's companion), so every batch size computes with the same rounded weights.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

from pagedserve.quant.base import QuantConfigError
from pagedserve.quant.gguf import GgufLinearMethod
from pagedserve.quant.unquantized import UnquantizedLinearMethod

HEAD_QUANTIZATIONS = ("none", "q8_0")
_BLOCK = 32


def quantized_head(head: nn.Module) -> nn.Module:
    """A Q8_0 copy of an unquantized head [vocab, hidden] (tied or not); the head is left as it is for the caller
    (a tied head's weight is the embedding's, which lookups keep reading). Raises QuantConfigError when the head
    is not an unquantized linear or its width is not whole blocks."""
    from pagedserve.quant.linear import QuantLinear

    field = "lm_head_quantization"
    if not isinstance(head, QuantLinear) or not isinstance(head.method, UnquantizedLinearMethod):
        method = type(getattr(head, "method", head)).__name__
        raise QuantConfigError(field, f"q8_0 quantizes an unquantized (16/32-bit) LM head; this one is {method}")
    if head.in_features % _BLOCK:
        raise QuantConfigError(field, f"q8_0 needs the hidden size to be a multiple of {_BLOCK}, got {head.in_features}")
    if head.bias is not None:
        raise QuantConfigError(field, "q8_0 quantizes a head without a bias only")
    weight = head.weight.detach().float().cpu().numpy()
    blocks = torch.from_numpy(np.ascontiguousarray(quantize(weight, GGMLQuantizationType.Q8_0)))
    method = GgufLinearMethod("Q8_0", dense_batches=True)
    compute = getattr(head, "compute_dtype", head.weight.dtype)  # fp32 over a 16-bit head: UnquantizedLinearMethod
    with torch.device("meta"):
        packed = QuantLinear(head.in_features, head.out_features, False, method, compute)
    packed.weight = nn.Parameter(blocks, requires_grad=False)
    packed.compute_dtype = compute
    return packed
