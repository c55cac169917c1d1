"""The quantization plug-in interface: a config parsed from the checkpoint, and a per-layer linear method.

Model code builds `QuantLinear` modules and only ever calls their forward (which calls `apply`);
everything format-specific lives behind `LinearMethod`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from pagedserve.quant.dense_layout import DenseEmbedding
from pagedserve.quant.native_linear import NativeLinear


class QuantConfigError(ValueError):
    """A checkpoint's quantization settings are unsupported or inconsistent; names the field or tensor."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class LinearMethod(ABC):
    """How one linear layer stores and multiplies its weights."""

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype
    ) -> None:
        """Register the tensors the checkpoint will fill, under the checkpoint's own names."""

    def load_tensor(self, layer: nn.Module, name: str, tensor: torch.Tensor, prefix: str) -> None:
        """Copy one checkpoint tensor into the layer. Default: exact shape match, cast to the slot's dtype."""
        slot = getattr(layer, name, None)
        if not isinstance(slot, torch.Tensor):
            raise QuantConfigError(f"{prefix}.{name}", "unexpected tensor for this quantization method")
        if tuple(slot.shape) != tuple(tensor.shape):
            raise QuantConfigError(
                f"{prefix}.{name}", f"shape {tuple(tensor.shape)} does not match expected {tuple(slot.shape)}"
            )
        with torch.no_grad():
            slot.copy_(tensor.to(slot.dtype))
        layer.loaded_tensors.add(name)

    def split_output(self, name: str, tensor: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """Checkpoint tensor `name` of a fused layer (Phi-3's qkv_proj) -> each part's, the parts being this method's
        layers with `sizes` outputs. Default: rows ([out, in] weights, GGUF block rows, [out] biases)."""
        if name in ("weight", "bias") and tensor.dim() >= 1 and tensor.shape[0] == sum(sizes):
            return tensor.split(list(sizes), 0)
        raise QuantConfigError(name, f"cannot split shape {tuple(tensor.shape)} into outputs of {list(sizes)}")

    def required_tensors(self, layer: nn.Module) -> set[str]:
        """Names that must come from the checkpoint (missing ones fail the load, naming the tensor)."""
        return {n for n, _ in layer.named_parameters(recurse=False)} | {n for n, _ in layer.named_buffers(recurse=False)}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack into the layout `apply` wants (once, at load, after `merge` has fused layers)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]."""

    def native_linear(self, layer: nn.Module) -> NativeLinear | None:
        """The layer as a C function for the native small-batch step (kernels/cpu/linear.h), or None where this
        method has no native kernel here; the step then keeps the layer on the torch path."""
        return None

    def free_row_bits(self, layer: nn.Module) -> None:
        """Told once the engine is built, where no step needs a row's bits to equal what a one-row step computed
        (speculative decoding off: nothing verifies drafts against the one-row steps' results). A method may then
        give small calls a faster kernel that sums in another order; each row's result still must not depend on
        the rows beside it. Default: nothing changes."""

    def merge(self, layers: list[nn.Module]) -> nn.Module | None:
        """One layer whose output is the concatenation of `layers`' outputs for the same input, or None.

        Fewer, larger matmuls matter on CPU, where small ones are dominated by per-call overhead.
        """
        return None


class QuantConfig(ABC):
    """One quantization method's settings, parsed from config.json's `quantization_config`."""

    name: ClassVar[str]
    # What `lm_head_quantization="auto"` makes of this method's unquantized LM head on CPU: "none" keeps it as
    # stored; "q8_0" for methods whose layers read fewer bytes than a 16-bit head (GPTQ/AWQ: quant/head_quant.py)
    auto_lm_head_quantization: ClassVar[str] = "none"

    @classmethod
    @abstractmethod
    def from_hf(cls, quantization_config: dict[str, Any]) -> "QuantConfig":
        ...

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod:
        """The method for the linear layer called `prefix` (e.g. `model.layers.0.self_attn.q_proj`)."""

    def router_method(self, prefix: str) -> LinearMethod:
        """A mixture-of-experts router's linear (`prefix`: its name). GPTQ/AWQ tools leave routers unquantized, as
        vLLM reads them; methods whose files say per tensor (plain, GGUF) answer as for any linear."""
        return self.linear_method(prefix)

    def embedding(self, prefix: str, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> nn.Module:
        """The token embedding called `prefix` (its forward maps ids to rows in `dtype`): a plain one unless the
        method keeps the checkpoint's own blocks (quant/gguf.py); a plain one reads its table in either dense layout,
        as a tied head's native kernel may regroup it (quant/dense_layout.py)."""
        return DenseEmbedding(num_embeddings, embedding_dim, dtype)

    def holding_weights_in(self, dtype: torch.dtype, compute_dtype: torch.dtype) -> "QuantConfig":
        """This config with its plain (unquantized) matrices held in `dtype` while the model computes in
        `compute_dtype` (16-bit weights on a CPU without 16-bit arithmetic: engine/loading/dtype_plan.py). Default:
        itself, the method's storage being its own."""
        return self

    def stores_tied_head(self) -> bool:
        """Whether the checkpoint holds the LM head's own quantized tensors although the model ties it to the
        embedding (GPTQModel's `lm_head: true` on a tied model): the model then builds a separate head from
        `linear_method("lm_head")` and looks tokens up in the embedding as stored. Default: the head is the
        embedding's table."""
        return False

    def describe(self) -> str:
        return self.name

