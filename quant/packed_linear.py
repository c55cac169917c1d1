"""The linear method GPTQ and AWQ share after loading: validate the checkpoint tensors, convert them once to the
canonical `GroupQuantWeight` (group_quant.py), and hand that to the kernel chosen for the layer
(qlinear_kernels.py). Weights stay packed.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from typing import ClassVar

import torch
from torch import nn

from pagedserve.quant.base import LinearMethod, QuantConfigError
from pagedserve.quant.group_quant import GroupQuantWeight
from pagedserve.quant.native_linear import NativeLinear
from pagedserve.quant.qlinear_kernels import select_kernel


class PackedLinearMethod(LinearMethod):
    """Shared load / post-process / apply for GPTQ and AWQ; subclasses define the checkpoint tensors
    and how they become a GroupQuantWeight."""

    CHECKPOINT_TENSORS: ClassVar[tuple[str, ...]]

    def __init__(self, prefix: str, kernel: str = "auto"):
        self.prefix = prefix
        self.kernel = kernel

    def load_tensor(self, layer: nn.Module, name: str, tensor: torch.Tensor, prefix: str) -> None:
        slot = getattr(layer, name, None) if name in self.CHECKPOINT_TENSORS + ("bias",) else None
        if not isinstance(slot, torch.Tensor):
            raise QuantConfigError(f"{prefix}.{name}", f"unexpected tensor for {type(self).__name__}")
        if tuple(slot.shape) != tuple(tensor.shape):
            raise QuantConfigError(f"{prefix}.{name}",
                                   f"shape {tuple(tensor.shape)} does not match expected {tuple(slot.shape)}")
        if slot.dtype == torch.int32 and tensor.dtype != torch.int32:
            raise QuantConfigError(f"{prefix}.{name}", f"dtype {tensor.dtype}, expected torch.int32")
        if slot.is_floating_point() and not tensor.is_floating_point():
            raise QuantConfigError(f"{prefix}.{name}", f"dtype {tensor.dtype}, expected a float tensor")
        # Float tensors keep the checkpoint's dtype (fp16 scales stay exact); ints are copied as is.
        setattr(layer, name, tensor.detach().to(slot.device).clone())
        layer.loaded_tensors.add(name)

    def output_packing(self, name: str) -> int:
        """How many output columns one stored column of checkpoint tensor `name` holds."""
        return 1

    def split_output(self, name: str, tensor: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """Packed tensors hold output columns (a fused qkv_proj splits by columns, whole int32 words apiece, exact);
        g_idx describes the shared input, so every part gets it whole."""
        if name == "bias":
            return super().split_output(name, tensor, sizes)
        if name == "g_idx":
            return (tensor,) * len(sizes)
        per = self.output_packing(name)
        if name not in self.CHECKPOINT_TENSORS or tensor.dim() != 2 or any(s % per for s in sizes) \
                or tensor.shape[1] * per != sum(sizes):
            raise QuantConfigError(f"{self.prefix}.{name}", f"cannot split shape {tuple(tensor.shape)} into "
                                   f"outputs of {list(sizes)} ({per} columns per stored column)")
        return tensor.split([s // per for s in sizes], 1)

    def _create_bias(self, layer: nn.Module, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        # GPTQ tools write a (zero) bias for every linear even where the architecture has none, so a bias
        # tensor is always accepted and only required when the layer has one.
        layer.register_buffer("bias", torch.zeros(out_features, dtype=dtype))
        layer.bias_required = bias
        layer.compute_dtype = dtype

    def required_tensors(self, layer: nn.Module) -> set[str]:
        names = set(self.required_checkpoint_tensors(layer))
        if layer.bias_required:
            names.add("bias")
        return names

    @abstractmethod
    def required_checkpoint_tensors(self, layer: nn.Module) -> tuple[str, ...]:
        ...

    @abstractmethod
    def to_group_quant(self, layer: nn.Module) -> GroupQuantWeight:
        """Validate the loaded tensors and convert them to the canonical layout."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.__dict__.pop("group_weight", None)  # a merged layer's, converted part by part (merge)
        if w is None:
            w = self.to_group_quant(layer)
        for name in self.CHECKPOINT_TENSORS:
            if hasattr(layer, name):
                delattr(layer, name)
        if "bias" not in layer.loaded_tensors or not bool(layer.bias.any()):
            layer.bias = None
        else:
            layer.bias = layer.bias.to(layer.compute_dtype)
        device = w.qweight.device
        cls = select_kernel(self.kernel, w, device, layer.compute_dtype, self.prefix)
        layer.qkernel = cls.from_weight(w, layer.compute_dtype)

    def merge(self, layers: list[nn.Module]) -> nn.Module | None:
        """q/k/v or gate/up as one layer when they share bits, scale dtype and g_idx (act-order can give each its
        own permutation): each part is converted on its own (its zero convention and checks), then the output
        columns are concatenated, which is exact. One matmul, and one native call per group in the decode step."""
        from pagedserve.quant.linear import QuantLinear

        if not all(type(layer.method) is type(self) for layer in layers):
            return None
        try:
            parts = [layer.method.to_group_quant(layer) for layer in layers]
        except QuantConfigError:  # left to each layer's own processing, which names the tensor
            return None
        first = parts[0]
        if any(w.bits != first.bits or w.scales.dtype != first.scales.dtype or not torch.equal(w.g_idx, first.g_idx)
               for w in parts):
            return None
        out = sum(w.out_features for w in parts)
        weight = GroupQuantWeight(torch.cat([w.qweight for w in parts], 1), torch.cat([w.qzeros for w in parts], 1),
                                  torch.cat([w.scales for w in parts], 1), first.g_idx, first.bits,
                                  first.in_features, out)
        with torch.device("meta"):
            merged = QuantLinear(first.in_features, out, False, copy.copy(self), layers[0].compute_dtype)
        for name in self.CHECKPOINT_TENSORS:
            if hasattr(merged, name):
                delattr(merged, name)
        merged.bias = torch.cat([layer.bias for layer in layers])
        merged.bias_required = any(layer.bias_required for layer in layers)
        merged.loaded_tensors = {"bias"} if any("bias" in layer.loaded_tensors for layer in layers) else set()
        merged.__dict__["group_weight"] = weight
        return merged

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = layer.qkernel(x.reshape(-1, x.shape[-1]))
        if layer.bias is not None:
            y = y + layer.bias.to(y.dtype)
        return y.reshape(*lead, y.shape[-1])

    def native_linear(self, layer: nn.Module) -> NativeLinear | None:
        return layer.qkernel.native_linear(layer.bias)
