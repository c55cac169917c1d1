"""Phi-3, Phi-3.5 and Phi-4-mini (Phi3ForCausalLM): the Llama block loaded from fused checkpoint projections.

The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` ([gate | up]); the loader splits
them into the Llama block's linears through their quant method (checkpoint_layout.py), and fuse_projections merges
them back, so Phi-3 shares the Llama attention, MLP, native decode step and LoRA layout. RoPE: LongRoPE's short and
long factors (per sequence length, rope.py), partial rotary (Phi-4-mini turns 96 of 128 dimensions; such a model
stays off the native step, which rotates whole heads); Phi3Config's legacy type names su and yarn both mean longrope.
`sliding_window` applies to every layer, as transformers' Phi-3 applies it.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from pagedserve.engine.models.checkpoint_layout import CheckpointLayout
from pagedserve.engine.models.llama import LlamaForCausalLM


class Phi3(LlamaForCausalLM):
    sliding = True
    rope_aliases = {"su": "longrope", "yarn": "longrope"}
    checkpoint_layout = CheckpointLayout(fused=MappingProxyType({
        "qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}))

    @staticmethod
    def biases(hf_config: dict[str, Any]) -> tuple[bool, bool]:
        return False, False  # transformers' Phi-3 has no attention biases whatever the config says


# Read by engine/models/registry.py, which registers every module of this package that defines ARCHITECTURES.
ARCHITECTURES = {"Phi3ForCausalLM": Phi3}
