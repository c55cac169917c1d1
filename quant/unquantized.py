"""Plain FP32/FP16/BF16 weights; on CPU packed once for oneDNN (see onednn_dense.py).

On a CPU without 16-bit arithmetic a 16-bit checkpoint's weights stay in its dtype (`weight_dtype`) while the model
computes in fp32, as llama.cpp does: half the bytes of fp32 in memory and per decode step. The native GEMV widens
them in registers; the torch path widens a few MB at a time (dense_layout.chunked_linear). bf16 -> fp32 and
fp16 -> fp32 are exact, so the products are the fp32 model's."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.quant.base import LinearMethod, QuantConfig
from pagedserve.quant.dense_layout import DenseEmbedding
from pagedserve.quant.native_linear import NativeLinear
from pagedserve.quant.onednn_dense import can_pack, has_onednn_bf16, pack_weight, packed_linear


# Up to this many rows the torch path multiplies weights the GEMV owns (16-bit under fp32 compute, or regrouped
# bf16) with the native GEMV (reading them once per 8 rows, no temporaries); past it a regrouped weight goes to the
# grouped GEMM (kernels/cpu/dense_gemm.c: any row count, same layout) and a row-major 16-bit one to fp32 slices for
# F.linear. Under fp32 compute the GEMM's sums are the GEMV's, bit for bit, so the limit is speed only.
_GEMV_ROWS = 32
# The limit stays 32 with AMX too, though its GEMM reads the weight once per block of rows where the GEMV reads it
# once per 8: AMX sums in its own order, and a speculative verify step of up to 32 rows then gets each row's bits
# as the one-row decode steps computed them. Without speculative decoding (`free_row_bits`) AMX takes calls from
# this many rows on: 2-7x the GEMV at 9-32 rows on the default model's shapes (one thread, noisy: docs/quantization.md).
_GEMV_ROWS_FREE = 8

# Without AMX the GEMM's FMA and vdpbf16ps tiles lead `chunked_linear` (whose F.linear is oneDNN's GEMM, blocked
# and tuned further) up to a few hundred rows but not at 2048 (1B shapes, SPR guest capped at AVX2 / AVX512-BF16,
# noisy: docs/quantization.md): past this many rows a call takes the slices. Where torch has no bf16 GEMM of its
# own (`has_onednn_bf16` false: an AVX2-only host), bf16 compute takes the grouped GEMM at every row count: its
# FMA tiles over x rounded to bf16 ran 79-133 GFLOP/s against F.linear's 15-20 at 64-2048 rows (Zen 3, 2 cores).
_GEMM_ROWS = 256

# fp32 compute over plain fp32 weights where `rows_gemm_routed`: calls of this many rows take the native GEMM over
# the plain weight (kernels/cpu/dense_rows.c), others torch's sgemm. Chosen on the default model's shapes, confirmed
# on the 1B's (Zen 3, 2 cores: docs/quantization.md): 1.2-4.9x MKL's sgemm at 2-64 rows, 0.95-1.39x at 256,
# 0.87-1.22x at 512, 0.79-1.02x at 2048; at one row MKL led on the small layers.
_ROWS_GEMM_SPAN = (2, 256)
# fp32 compute over grouped bf16 weights (`--dtype auto` on a host without bf16 arithmetic) where `rows_gemm_routed`
# and `free_row_bits`: the same GEMM over the group widened a chunk at a time, which sums in its own order (one
# chain per output, where the GEMV and the grouped GEMM keep even and odd inputs apart). The GEMV keeps calls up to
# the span's first row count less one; past its last, `chunked_linear`. Chosen on the default model's shapes,
# confirmed on the 1B's (Zen 3, 2 cores: docs/quantization.md).
_GROUPED_ROWS_GEMM_SPAN = (13, 512)


class UnquantizedLinearMethod(LinearMethod):
    def __init__(self, weight_dtype: torch.dtype | None = None):
        """weight_dtype: the weight's dtype in memory when it differs from the compute dtype (16-bit weights of an
        fp32-compute model); None: the compute dtype."""
        self.weight_dtype = weight_dtype

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=self.weight_dtype or dtype),
                                    requires_grad=False)
        layer.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        layer.packed_weight = None
        layer.compute_dtype = dtype
        layer.small_batch_gemv = None  # the native GEMV over regrouped or widened weights, once native_linear made it
        layer.gemm_rows = _GEMM_ROWS  # the most rows `apply` gives the grouped GEMM (None: no limit)
        layer.gemm_on_amx = False  # the grouped GEMM runs on AMX tiles (its own summation order)
        layer.gemv_rows = _GEMV_ROWS  # the most rows `apply` gives the GEMV (fewer once free_row_bits allows it)
        layer.rows_gemm = None  # dense_rows.c's GEMM: over a plain fp32 weight (`_rows_gemm_takes`) or a grouped one
        layer.rows_gemm_span = _ROWS_GEMM_SPAN  # the row counts `apply` gives it

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # A shared weight (a tied LM head's is the embedding's table, which lookups read) is not packed: the packed
        # copy would sit beside the table, the vocabulary's weights held twice (+0.21x a bf16 SmolLM2's weight bytes
        # on the torch path: benchmarks/dense_memory.py), for a head ~1.4x faster at 1-16 rows (bf16, noisy host).
        # 16-bit weights of an fp32 model stay as they are: a packed copy would be 16-bit math or twice the bytes.
        if can_pack(layer.weight) and not layer.weight_shared and self.weight_dtype is None:
            layer.packed_weight = pack_weight(layer.weight)
            layer.weight = None  # the packed copy replaces it: one copy of the weights in memory
        elif _rows_gemm_takes(layer.weight):
            from pagedserve.quant.dense_native import dense_native_linear

            layer.rows_gemm = dense_native_linear(layer.weight, layer.bias)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        low, high = layer.rows_gemm_span
        if (layer.rows_gemm is not None and x.dtype == torch.float32
                and low * x.shape[-1] <= x.numel() <= high * x.shape[-1]):
            from pagedserve.quant.dense_native import dense_rows_gemm

            flat = dense_rows_gemm(layer.rows_gemm, x.reshape(-1, x.shape[-1]))
            return flat.view(*x.shape[:-1], flat.shape[-1])
        if layer.packed_weight is not None:
            return packed_linear(x, layer.packed_weight, layer.bias)
        from pagedserve.quant.dense_layout import chunked_linear, row_group

        native = layer.small_batch_gemv
        if native is not None and x.numel() <= layer.gemv_rows * x.shape[-1]:
            from pagedserve.quant.dense_native import call_native_linear

            flat = call_native_linear(native, x.reshape(-1, x.shape[-1]).float())
            return flat.to(x.dtype).view(*x.shape[:-1], flat.shape[-1])
        if (native is not None and row_group(layer.weight) and x.dtype in (torch.float32, torch.bfloat16)
                and (layer.gemm_rows is None or x.numel() <= layer.gemm_rows * x.shape[-1])):
            from pagedserve.quant.dense_native import dense_gemm

            flat = dense_gemm(native, x.reshape(-1, x.shape[-1]))  # the regrouped weight as it is: no rewrite
            return flat.view(*x.shape[:-1], flat.shape[-1])
        # regrouped past the GEMM's rows (or without one), or 16-bit row-major under fp32 compute: slices
        if row_group(layer.weight) or layer.weight.dtype != x.dtype:
            return chunked_linear(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def native_linear(self, layer: nn.Module) -> NativeLinear | None:
        """The bf16/fp16/fp32 GEMV of kernels/cpu/dense_linear.c over the layer's one plain weight; None off CPU or
        where the native kernels do not build. One copy of the weights: a oneDNN packed copy is turned back into
        the plain weight, which then serves the torch path too (oneDNN reorders a plain weight per call, a small
        cost beside a prefill's GEMM), and bf16 weights are regrouped in place for the faster kernel
        (quant/dense_layout.py; `apply` and the embedding read that layout as well). A tied head's weight is the
        embedding's own tensor."""
        from pagedserve.kernels.cpu.native import available
        from pagedserve.quant.dense_layout import can_group, group_rows_in_place
        from pagedserve.quant.dense_native import dense_native_linear, gemm_isa, plain_weight
        from pagedserve.quant.native_linear import (AVX2_DENSE_FP32_NATIVE_MAX_BATCH, DEFAULT_NATIVE_MAX_BATCH,
                                                    GROUPED_NATIVE_MAX_BATCH)

        weight = layer.weight if layer.weight is not None else layer.packed_weight
        if weight is None or weight.device.type != "cpu" or not available():
            return None
        plain = plain_weight(weight)
        if layer.weight is None:
            layer.weight = nn.Parameter(plain, requires_grad=False)
            plain = layer.weight  # the layout mark (group_rows_in_place) goes on the tensor the layer holds
        layer.packed_weight = None
        grouped = can_group(plain)
        if grouped:
            group_rows_in_place(plain)
        if self.weight_dtype is None and not grouped:
            routed = _rows_gemm_takes(plain)
            native = dense_native_linear(plain, layer.bias, native_max_batch=AVX2_DENSE_FP32_NATIVE_MAX_BATCH
                                         if routed else DEFAULT_NATIVE_MAX_BATCH)
            layer.rows_gemm = native if routed else None  # the same kernel state: the GEMM reads it too
            return native
        # Regrouped bf16 weights, or 16-bit weights under fp32 compute: the torch path would turn the whole matrix
        # row-major (or fp32) per call, so the GEMV, which reads it once for up to 8 rows, stays ahead through 8
        # sequences (docs/benchmarks.md, the 1B bf16 rows).
        layer.small_batch_gemv = dense_native_linear(plain, layer.bias, x_fp32=self.weight_dtype is not None,
                                                     native_max_batch=GROUPED_NATIVE_MAX_BATCH)
        if grouped:
            layer.gemm_on_amx = gemm_isa(x_fp32=self.weight_dtype is not None) == "amx"
            if layer.gemm_on_amx or (self.weight_dtype is None and not has_onednn_bf16()):
                layer.gemm_rows = None
        return layer.small_batch_gemv

    def free_row_bits(self, layer: nn.Module) -> None:
        if layer.small_batch_gemv is not None and layer.gemm_on_amx:  # AMX sums in its own order
            layer.gemv_rows = _GEMV_ROWS_FREE
        elif layer.small_batch_gemv is not None and _grouped_rows_gemm_takes(layer.weight, self.weight_dtype):
            layer.rows_gemm, layer.rows_gemm_span = layer.small_batch_gemv, _GROUPED_ROWS_GEMM_SPAN
            layer.gemv_rows = _GROUPED_ROWS_GEMM_SPAN[0] - 1

    def merge(self, layers: list[nn.Module]) -> nn.Module | None:
        from pagedserve.quant.linear import QuantLinear

        if not all(isinstance(layer.method, UnquantizedLinearMethod) for layer in layers):
            return None
        weight = torch.cat([layer.weight for layer in layers])
        has_bias = any(layer.bias is not None for layer in layers)
        compute = layers[0].compute_dtype
        merged = QuantLinear(layers[0].in_features, weight.shape[0], has_bias,
                             UnquantizedLinearMethod(self.weight_dtype), compute)
        merged.to(weight.device)
        with torch.no_grad():
            merged.weight.copy_(weight)
            if has_bias:
                merged.bias.copy_(torch.cat([
                    layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.out_features, dtype=compute)
                    for layer in layers
                ]))
        return merged


def _grouped_rows_gemm_takes(weight: torch.Tensor, weight_dtype: torch.dtype | None) -> bool:
    """Whether fp32 calls over this grouped bf16 weight of an fp32-compute model may go to the native GEMM
    (kernels/cpu/dense_rows.c) once no step needs the GEMV's bits: in a build that routes them."""
    from pagedserve.quant.dense_layout import row_group
    from pagedserve.quant.dense_native import rows_gemm_routed

    return weight_dtype == torch.bfloat16 and bool(row_group(weight)) and rows_gemm_routed()


def _rows_gemm_takes(weight: torch.Tensor) -> bool:
    """Whether fp32 calls over this plain weight go to the native GEMM (kernels/cpu/dense_rows.c): an fp32 [out, in]
    CPU weight in a build that routes them (`rows_gemm_routed`)."""
    from pagedserve.quant.dense_native import rows_gemm_routed

    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2 and rows_gemm_routed()


class UnquantizedConfig(QuantConfig):
    name = "none"

    def __init__(self, weight_dtype: torch.dtype | None = None):
        self.weight_dtype = weight_dtype  # UnquantizedLinearMethod's: None, or 16-bit weights for fp32 compute

    @classmethod
    def from_hf(cls, quantization_config: dict[str, Any]) -> "UnquantizedConfig":
        return cls()

    def holding_weights_in(self, dtype: torch.dtype, compute_dtype: torch.dtype) -> "UnquantizedConfig":
        return UnquantizedConfig(None if dtype == compute_dtype else dtype)

    def linear_method(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod(self.weight_dtype)

    def embedding(self, prefix: str, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> nn.Module:
        return DenseEmbedding(num_embeddings, embedding_dim, dtype, self.weight_dtype)


class PlainLayersIn16Bit:
    """Mixed into a quantization method's config (a frozen dataclass with a `plain_weights` field) whose checkpoints
    leave some layers unquantized (GPTQ/AWQ: the embedding, a 16-bit head): those layers are held as
    UnquantizedConfig holds a plain checkpoint's, in its 16-bit dtype under fp32 compute (engine/loading/
    dtype_plan.py), not expanded to fp32."""

    __slots__ = ()
    plain_weights: torch.dtype | None

    def holding_weights_in(self, dtype: torch.dtype, compute_dtype: torch.dtype) -> "PlainLayersIn16Bit":
        return dataclasses.replace(self, plain_weights=None if dtype == compute_dtype else dtype)

    def embedding(self, prefix: str, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> nn.Module:
        return DenseEmbedding(num_embeddings, embedding_dim, dtype, self.plain_weights)

    def plain_linear_method(self) -> LinearMethod:
        """The method of a linear the checkpoint leaves unquantized."""
        return UnquantizedLinearMethod(self.plain_weights)

    def router_method(self, prefix: str) -> LinearMethod:
        return self.plain_linear_method()  # never quantized by GPTQ/AWQ tools
