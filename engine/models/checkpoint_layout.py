"""How a family's checkpoint tensor names differ from its module names, declared by the model class and applied by
the loader (engine/loading/model_loader.py).

Three differences occur among the registered families: name parts (Mixtral's `block_sparse_moe` and experts'
`w1`/`w2`/`w3` for the shared MoE module names), prefixes (Gemma 3's multimodal checkpoints keep the text model under
`model.language_model.` or, saved by transformers 4, `language_model.model.`, beside a vision tower the text model
does not use), and fused projections (Phi-3 stores q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj`). A fused tensor is split into the Llama block's separate linears by their quant method
(`LinearMethod.split_output`, which knows how each format packs output columns), and `fuse_projections` merges
them back after loading, so every family shares one attention and MLP code path, native step and LoRA layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    renames: tuple[tuple[str, str], ...] = ()  # (checkpoint prefix, module prefix), the first match applies
    # (checkpoint name part, module name part) replaced wherever they occur, every one in order (Mixtral's
    # `.block_sparse_moe.` and experts' `.w1.`: the same parts in every layer)
    infixes: tuple[tuple[str, str], ...] = ()
    skipped: tuple[str, ...] = ()  # checkpoint prefixes outside the text model (vision tower, projector)
    # last name component of a fused checkpoint module -> its parts' names in output order (siblings of it)
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        for name, parts in self.fused.items():
            if len(parts) < 2 or "." in name:
                raise ValueError(f"CheckpointLayout.fused[{name!r}]: a module name and at least two parts")

    def module_key(self, key: str) -> str | None:
        """The model's name for checkpoint tensor `key`, or None for a tensor the text model does not use."""
        if key.startswith(self.skipped):
            return None
        for old, new in self.infixes:
            key = key.replace(old, new)
        for old, new in self.renames:
            if key.startswith(old):
                return new + key[len(old):]
        return key

    def fused_parts(self, module_name: str) -> tuple[str, ...]:
        """The module names a fused checkpoint module splits into (empty: it is not a fused one)."""
        parent, _, name = module_name.rpartition(".")
        parts = self.fused.get(name, ())
        return tuple(f"{parent}.{part}" if parent else part for part in parts)


PLAIN = CheckpointLayout()
