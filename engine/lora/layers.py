"""The batched LoRA compute: each adaptable linear of the base is wrapped in a `LoraLinear` that adds, for every
distinct adapter of the step, shrink-then-expand over that adapter's tokens only (vLLM's punica ops, in torch).

The token -> adapter grouping is one `StepAdapters` the model runner fills once per step (its `groups`: each
distinct adapter with the indices of its tokens, or None when every token of the step uses it). A layer loops over
the step's distinct adapters (at most `max_loras`), never over requests; tokens of the base pay nothing. The delta is
computed from the layer's input, so it is the same on every base: dense, GPTQ/AWQ, GGUF packed or dequantized.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.engine.lora.weights import LoraLayout, LoraWeights


class StepAdapters:
    """This step's adapters: [(adapter, token indices [n] int64 or None for all tokens)], base tokens in none."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[tuple[LoraWeights, torch.Tensor | None]] = []

    def set_rows(self, rows: list[tuple[LoraWeights | None, int, int]], num_tokens: int, device: torch.device) -> None:
        """rows: (adapter or None, first token, end) per scheduled sequence, in token order."""
        spans: dict[int, tuple[LoraWeights, list[range]]] = {}
        for adapter, start, end in rows:
            if adapter is not None and end > start:
                spans.setdefault(adapter.adapter_id, (adapter, []))[1].append(range(start, end))
        groups: list[tuple[LoraWeights, torch.Tensor | None]] = []
        for adapter, ranges in spans.values():
            count = sum(len(r) for r in ranges)
            if count == num_tokens:
                groups.append((adapter, None))  # the whole step is one adapter: no gather, no scatter
            else:
                index = [i for r in ranges for i in r]
                groups.append((adapter, torch.tensor(index, dtype=torch.int64, device=device)))
        self.groups = groups

    def clear(self) -> None:
        self.groups = []


class LoraLinear(nn.Module):
    """base(x) + the step's adapter deltas for this slot; the base layer is kept as it is (its own kernels)."""

    def __init__(self, base: nn.Module, slot: int, step: StepAdapters):
        super().__init__()
        self.base = base
        self.slot = slot
        self.step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for adapter, rows in self.step.groups:
            pair = adapter.slots[self.slot]
            if pair is None:
                continue
            a_t, b_t = pair
            if rows is None:
                out.addmm_(x @ a_t, b_t)
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a_t) @ b_t)
        return out

    def extra_repr(self) -> str:
        return f"slot={self.slot}"


def wrap_model(model: nn.Module, layout: LoraLayout, step: StepAdapters) -> None:
    """Replaces every slot's linear in `model` by a LoraLinear over it (after loading, fusing and building the native
    step, which keeps the bare layers)."""
    for index, slot in enumerate(layout.slots):
        owner_path, _, name = slot.path.rpartition(".")
        owner = model.get_submodule(owner_path)
        setattr(owner, name, LoraLinear(getattr(owner, name), index, step))
