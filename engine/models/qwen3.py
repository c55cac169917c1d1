"""Qwen3 dense models: the Llama block with an RMSNorm over each q and k head before RoPE (`qk_norm`).

Everything else is read from the config as for Qwen2 (no q/k/v biases unless `attention_bias`, sliding windows only
with `use_sliding_window`, tied heads on the small sizes, YaRN through rope_scaling). The native decode step applies
the q/k norms too (kernels/cpu/decode_step.c).
"""

from __future__ import annotations

from pagedserve.engine.models.llama import LlamaForCausalLM


class Qwen3(LlamaForCausalLM):
    sliding = True  # as Qwen2: only with use_sliding_window, from max_window_layers on
    qk_norm = True


# Read by engine/models/registry.py, which registers every module of this package that defines ARCHITECTURES.
ARCHITECTURES = {"Qwen3ForCausalLM": Qwen3}
