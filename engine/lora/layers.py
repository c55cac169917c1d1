"""The batched LoRA compute: each adaptable linear of the base is wrapped in a `LoraLinear` that adds, for every
distinct adapter of the step, shrink-then-expand over that adapter's tokens only (what vLLM's punica ops do).

The token -> adapter grouping is one `StepAdapters` the model runner fills once per step: it orders the step's
sequences by adapter, so each distinct adapter's tokens are one contiguous span and a layer adds its delta to a view
of those rows (no gather, no scatter). A layer loops over the step's distinct adapters (at most `max_loras`), never
over requests; tokens of the base pay nothing. The delta is computed from the layer's input, so it is the same on
every base: dense, GPTQ/AWQ, GGUF packed or dequantized.

On CPU the adapters' matrices are float32 whatever the compute dtype (`lora_dtype`) and one native call per layer
(kernels/cpu/lora.c) adds every adapter's delta: in torch each adapter costs a shrink, an expand and an add per
layer, calls whose fixed cost dominated at decode sizes (oneDNN's bf16 GEMM ~40 us a call for rank-wide matrices).
Where the kernel does not build, or widths are not multiples of 16, the torch path runs (float32 GEMMs: 3-5x faster
than bf16 ones at these sizes, measured on Sapphire Rapids).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.engine.lora.weights import LoraLayout, LoraWeights
from pagedserve.kernels.cpu.lora import lora_delta, supports

# Steps with at least this many adapter rows split the native LoRA kernel across torch's threads (fewer: one
# thread, which beats waking the pool for a few microseconds of work).
NATIVE_SPLIT_ROWS = 8


def lora_dtype(compute: torch.dtype, device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else compute


class StepAdapters:
    """This step's adapters: [(adapter, first token, end)], one contiguous span per adapter (the runner orders the
    step's sequences by adapter), base tokens in none. With the native kernel, also the spans and every slot's
    matrices of those adapters as it reads them (`spans` [G, 2], `refs` [slots, G, REF_FIELDS]), built once per
    step."""

    __slots__ = ("groups", "native", "spans", "refs", "threads")

    def __init__(self, native: bool = False) -> None:
        self.native = native  # the native kernel is built here (kernels/cpu/lora.c)
        self.clear()

    def set_spans(self, rows: list[tuple[LoraWeights | None, int, int]]) -> None:
        """rows: (adapter or None, first token, end) per scheduled sequence, in token order, each adapter's rows
        next to each other."""
        groups: list[tuple[LoraWeights, int, int]] = []
        for adapter, start, end in rows:
            if adapter is None or end == start:
                continue
            if groups and groups[-1][0] is adapter and groups[-1][2] == start:
                groups[-1] = (adapter, groups[-1][1], end)
            else:
                groups.append((adapter, start, end))
        self.groups = groups
        self.spans = self.refs = None
        if groups and self.native and all(adapter.refs is not None for adapter, _, _ in groups):
            self.spans = torch.tensor([[start, end] for _, start, end in groups], dtype=torch.int64)
            self.refs = torch.stack([adapter.refs for adapter, _, _ in groups], dim=1).contiguous()
            rows_total = sum(end - start for _, start, end in groups)
            self.threads = torch.get_num_threads() if rows_total >= NATIVE_SPLIT_ROWS else 1

    def clear(self) -> None:
        self.groups: list[tuple[LoraWeights, int, int]] = []
        self.spans: torch.Tensor | None = None
        self.refs: torch.Tensor | None = None
        self.threads = 1


class LoraLinear(nn.Module):
    """base(x) + the step's adapter deltas for this slot; the base layer is kept as it is (its own kernels)."""

    def __init__(self, base: nn.Module, slot: int, step: StepAdapters):
        super().__init__()
        self.base = base
        self.slot = slot
        self.step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        step = self.step
        if not step.groups:
            return out
        if step.refs is not None and supports(x, out):
            lora_delta(x, out, step.spans, step.refs[self.slot], step.threads)  # every adapter in one call
            return out
        groups = step.groups
        first = groups[0][1]  # the adapters' spans follow the base's tokens: convert them once
        rows = x[first:] if groups[0][0].dtype == x.dtype else x[first:].to(groups[0][0].dtype)
        for adapter, start, end in groups:
            pair = adapter.slots[self.slot]
            if pair is None:
                continue
            shrunk = rows[start - first:end - first] @ pair[0].T  # views: no gather, the delta lands in place
            if out.dtype == shrunk.dtype:
                out[start:end].addmm_(shrunk, pair[1])
            else:
                out[start:end] += shrunk @ pair[1]
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
