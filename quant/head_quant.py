"""An unquantized LM head served from Q8_0 blocks made at load (`EngineConfig.lm_head_quantization`: "q8_0", or
"auto", the default, which picks it for GPTQ/AWQ checkpoints on CPU).

Why: GPTQ/AWQ exports of tied models (SmolLM2, Gemma 3, Qwen2 small sizes) keep the head in 16 bits, and no AWQ
tool quantizes it: there the head is the largest single read of a decode step (SmolLM2-135M: 56.6 MB of 113 MB per
token), where a GGUF file holds it in Q8_0 (30.1 MB), as llama.cpp's converter writes it. It changes the
checkpoint's numerics: each 32-weight block rounded to int8 with one fp16 scale (gguf's own quantizer, so the
blocks are what a GGUF file would hold); measured on held-out text that costs +0.02% perplexity and 99.6% top-1
agreement in bf16 (docs/quantization.md), far inside what the 4-bit layers already cost. So `auto` takes it where
the layers are 4/8-bit groups (`QuantConfig.auto_lm_head_quantization`: GPTQ, AWQ) and the host computes on CPU,
and nowhere else: a 16-bit model keeps its head unless asked, and `none` keeps any head as stored. A tied head's
embedding becomes the same blocks (`PackedEmbedding`, as a GGUF file's Q8_0 `token_embd` is read): one table, not a
16-bit one for lookups beside the head's blocks, so the resident set shrinks instead of growing; lookups then read
rows rounded as the head's are (measured with the head: docs/quantization.md). Batches past the packed kernel's
rows multiply the blocks expanded once (the GGUF `auto` mode's companion, where the build has no many-row form),
so every batch size computes with the same rounded weights.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

from pagedserve.quant.base import QuantConfig, QuantConfigError
from pagedserve.quant.gguf import GgufLinearMethod, PackedEmbedding
from pagedserve.quant.unquantized import UnquantizedLinearMethod

HEAD_QUANTIZATIONS = ("auto", "none", "q8_0")
_BLOCK = 32


def resolve_head_quantization(requested: str, quant: QuantConfig, head: nn.Module | None, device: torch.device,
                              kernels_build: Callable[[], bool]) -> str:
    """The head format `requested` means for this model: "auto" becomes the quantization method's choice on CPU when
    the head is one `quantized_head` takes (unquantized, whole blocks, no bias) and the packed kernels build here,
    "none" otherwise; an explicit name is returned as given (and refused later if it cannot apply)."""
    if requested != "auto":
        return requested
    if device.type != "cpu" or quant.auto_lm_head_quantization == "none" or _unfit_reason(head) is not None:
        return "none"
    return quant.auto_lm_head_quantization if kernels_build() else "none"


def _unfit_reason(head: nn.Module | None) -> str | None:
    from pagedserve.quant.linear import QuantLinear

    if not isinstance(head, QuantLinear) or not isinstance(head.method, UnquantizedLinearMethod):
        method = type(getattr(head, "method", head)).__name__
        return f"q8_0 quantizes an unquantized (16/32-bit) LM head; this one is {method}"
    if head.in_features % _BLOCK:
        return f"q8_0 needs the hidden size to be a multiple of {_BLOCK}, got {head.in_features}"
    if head.bias is not None:
        return "q8_0 quantizes a head without a bias only"
    return None


def quantize_lm_head(model: nn.Module) -> None:
    """`model.lm_head` multiplied from Q8_0 blocks; with a tied head the embedding becomes a `PackedEmbedding` over
    the same blocks (looked up as the head rounds them), so the 16-bit table is dropped, not kept beside them."""
    head = model.lm_head
    owner = _tied_embedding(model, head)
    packed = quantized_head(head)
    if owner is None:
        model.lm_head = packed
        return
    parent, name, embedding = owner
    table = PackedEmbedding("Q8_0", head.out_features, head.in_features,
                            getattr(embedding, "out_dtype", embedding.weight.dtype), dense_batches=True)
    table.weight = packed.weight
    setattr(parent, name, table)
    model.lm_head = table.as_linear()


def _tied_embedding(model: nn.Module, head: nn.Module) -> tuple[nn.Module, str, nn.Module] | None:
    """(parent, attribute, module) of the embedding whose table `head` reads (a tied head), or None."""
    if not getattr(head, "weight_shared", False):
        return None
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is not head and getattr(child, "weight", None) is head.weight:
                return parent, name, child
    return None


def quantized_head(head: nn.Module) -> nn.Module:
    """A Q8_0 copy of an unquantized head [vocab, hidden] (tied or not); the head is left as it is for the caller.
    Raises QuantConfigError when the head is not an unquantized linear or its width is not whole blocks."""
    from pagedserve.quant.linear import QuantLinear

    if (reason := _unfit_reason(head)) is not None:
        raise QuantConfigError("lm_head_quantization", reason)
    weight = head.weight.detach().float().cpu().numpy()
    blocks = torch.from_numpy(np.ascontiguousarray(quantize(weight, GGMLQuantizationType.Q8_0)))
    method = GgufLinearMethod("Q8_0", dense_batches=True)
    compute = getattr(head, "compute_dtype", head.weight.dtype)  # fp32 over a 16-bit head: UnquantizedLinearMethod
    with torch.device("meta"):
        packed = QuantLinear(head.in_features, head.out_features, False, method, compute)
    packed.weight = nn.Parameter(blocks, requires_grad=False)
    packed.compute_dtype = compute
    return packed
