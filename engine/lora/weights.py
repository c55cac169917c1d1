"""Where adapters attach to the base (`LoraSlot`: one linear of the loaded model, fused or not) and one adapter's
weights laid out for those slots (`LoraWeights`).

The models fuse q/k/v and gate/up into one matmul after loading (`merge_linears`), so a slot may hold several of
PEFT's modules: an adapter's A matrices for them are stacked ([r_q + r_k + r_v, in]) and its B matrices placed
block-diagonally ([out_q + out_k + out_v, r_q + r_k + r_v]), so each fused layer costs one shrink and one expand per
adapter whatever it targets. The scale (alpha/r, or alpha/sqrt(r) with rsLoRA) is folded into B at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.engine.core.seq_features import SeqFeature
from pagedserve.engine.errors import ConfigError
from pagedserve.engine.lora.config import AdapterInfo
from pagedserve.kernels.cpu.lora import lora_ref

# PEFT module names pagedserve can adapt, by the model part that holds them, with the fused linear they may live in.
FUSED_GROUPS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "self_attn": (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("o_proj", ("o_proj",))),
    "mlp": (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))),
}
SUPPORTED_TARGETS = tuple(part for groups in FUSED_GROUPS.values() for _, parts in groups for part in parts)


@dataclass(frozen=True, slots=True)
class LoraSlot:
    """One linear of the base an adapter may add to: `path` is its module path in the loaded model (the fused one,
    e.g. model.layers.0.self_attn.qkv_proj), `parts` PEFT's module names it computes with their output widths, in
    output order."""

    path: str
    layer: int
    owner: str  # "self_attn" or "mlp"
    parts: tuple[tuple[str, int], ...]
    in_features: int

    @property
    def out_features(self) -> int:
        return sum(width for _, width in self.parts)


@dataclass(frozen=True, slots=True)
class LoraLayout:
    """Every slot of the base model, and where each PEFT module (layer, owner, name) lands: (slot index, its output
    offset in the slot, its width)."""

    slots: tuple[LoraSlot, ...]
    num_layers: int

    def find(self, layer: int, owner: str, part: str) -> tuple[int, int, int] | None:
        for index, slot in enumerate(self.slots):
            if slot.layer != layer or slot.owner != owner:
                continue
            offset = 0
            for name, width in slot.parts:
                if name == part:
                    return index, offset, width
                offset += width
        return None


def part_shapes(args) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in, out) of the base layer, from the model's args (Llama family, Gemma 3)."""
    hidden, inter = args.hidden_size, args.intermediate_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def model_layout(model: nn.Module) -> LoraLayout:
    """The slots of a loaded model (after fuse_projections): a fused linear where the model fused, else one slot per
    PEFT module."""
    shapes = part_shapes(model.args)
    slots: list[LoraSlot] = []
    for index, layer in enumerate(model.model.layers):
        for owner_name, groups in FUSED_GROUPS.items():
            owner = getattr(layer, owner_name)
            for fused, parts in groups:
                prefix = f"model.layers.{index}.{owner_name}"
                if getattr(owner, fused, None) is not None and len(parts) > 1:
                    slots.append(LoraSlot(f"{prefix}.{fused}", index, owner_name,
                                          tuple((p, shapes[p][1]) for p in parts), shapes[parts[0]][0]))
                else:
                    if any(getattr(owner, p, None) is None for p in parts):
                        raise ConfigError("lora", f"layer {index}'s {owner_name} has no {', '.join(parts)}: LoRA "
                                          "adapters apply to dense layers (a mixture of experts has none)")
                    slots += [LoraSlot(f"{prefix}.{p}", index, owner_name, ((p, shapes[p][1]),), shapes[p][0])
                              for p in parts]
    return LoraLayout(tuple(slots), len(model.model.layers))


class LoraWeights(SeqFeature):
    """One loaded adapter: per slot of the layout, (A [R, in], B^T [R, out]) with the scale folded into B (and, for
    a fused slot, B^T's blocks as (r0, r1, c0, c1)), or None where the adapter leaves the slot alone. Immutable once built; a request holds it while it runs, so evicting or
    unloading the adapter never changes a running request. `refs` [slots, REF_FIELDS] int64: the same matrices as
    the native kernel reads them (kernels/cpu/lora.py), when they are fp32 on CPU."""

    __slots__ = ("info", "slots", "dtype", "refs")

    def __init__(self, info: AdapterInfo, slots: tuple[tuple | None, ...]):
        self.info = info
        self.slots = slots
        self.dtype = next((pair[0].dtype for pair in slots if pair is not None), torch.float32)
        on_cpu = all(pair is None or pair[0].device.type == "cpu" for pair in slots)
        self.refs = torch.tensor([lora_ref(*(pair or (None, None))) for pair in slots], dtype=torch.int64) \
            if self.dtype == torch.float32 and on_cpu and slots else None

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def adapter_id(self) -> int:
        return self.info.adapter_id

    def fork(self, index: int) -> LoraWeights:
        """A request's samples share its adapter."""
        return self

    def __repr__(self) -> str:
        return f"LoraWeights({self.info.name!r}, id={self.info.adapter_id}, rank={self.info.rank})"
