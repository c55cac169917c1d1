"""Plain FP32/FP16/BF16 weights; on CPU packed once for oneDNN (see onednn_dense.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.quant.base import LinearMethod, QuantConfig
from pagedserve.quant.native_linear import NativeLinear
from pagedserve.quant.onednn_dense import can_pack, pack_weight, packed_linear


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        layer.packed_weight = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # A shared weight (a tied LM head's is the embedding's table, which lookups read) is not packed: the packed
        # copy would sit beside the table, the vocabulary's weights held twice (+0.21x a bf16 SmolLM2's weight bytes
        # on the torch path: benchmarks/dense_memory.py), for a head ~1.4x faster at 1-16 rows (bf16, noisy host).
        if can_pack(layer.weight) and not layer.weight_shared:
            layer.packed_weight = pack_weight(layer.weight)
            layer.weight = None  # the packed copy replaces it: one copy of the weights in memory

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.packed_weight is not None:
            return packed_linear(x, layer.packed_weight, layer.bias)
        from pagedserve.quant.dense_layout import grouped_linear, row_group

        if row_group(layer.weight):  # regrouped by the native step (its only copy): row-major a slice at a time
            return grouped_linear(x, layer.weight, layer.bias)
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
        from pagedserve.quant.dense_native import dense_native_linear, plain_weight

        weight = layer.weight if layer.weight is not None else layer.packed_weight
        if weight is None or weight.device.type != "cpu" or not available():
            return None
        plain = plain_weight(weight)
        if layer.weight is None:
            layer.weight = nn.Parameter(plain, requires_grad=False)
            plain = layer.weight  # the layout mark (group_rows_in_place) goes on the tensor the layer holds
        layer.packed_weight = None
        if can_group(plain):
            group_rows_in_place(plain)
        return dense_native_linear(plain, layer.bias)

    def merge(self, layers: list[nn.Module]) -> nn.Module | None:
        from pagedserve.quant.linear import QuantLinear

        if not all(isinstance(layer.method, UnquantizedLinearMethod) for layer in layers):
            return None
        weight = torch.cat([layer.weight for layer in layers])
        has_bias = any(layer.bias is not None for layer in layers)
        merged = QuantLinear(layers[0].in_features, weight.shape[0], has_bias, UnquantizedLinearMethod(), weight.dtype)
        merged.to(weight.device)
        with torch.no_grad():
            merged.weight.copy_(weight)
            if has_bias:
                merged.bias.copy_(torch.cat([
                    layer.bias if layer.bias is not None else weight.new_zeros(layer.out_features) for layer in layers
                ]))
        return merged


class UnquantizedConfig(QuantConfig):
    name = "none"

    @classmethod
    def from_hf(cls, quantization_config: dict[str, Any]) -> "UnquantizedConfig":
        return cls()

    def linear_method(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod()
