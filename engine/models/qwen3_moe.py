"""Qwen3 mixture-of-experts models (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): the Qwen3 block whose MLP,
on its sparse layers, is a router over `num_experts` SiLU-gated experts, each token taking `num_experts_per_tok`.

The experts are `engine/models/moe.py`'s (renormalised when `norm_topk_prob`). Layers listed in `mlp_only_layers`,
or off the `decoder_sparse_step` stride, keep a dense MLP of `intermediate_size`. Experts load by the checkpoint's names
(`mlp.experts.N.gate_proj`, ...), so GPTQ/AWQ checkpoints that quantize each expert load as they are. The native decode
step runs dense MLPs only: these models keep the torch path (`LlamaForCausalLM.decoder_stack` says why).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.engine.models.llama import MLP
from pagedserve.engine.models.moe import SparseMoeMLP
from pagedserve.engine.models.qwen3 import Qwen3
from pagedserve.quant.base import QuantConfig


class Qwen3Moe(Qwen3):
    def build_mlp(self, hf_config: dict[str, Any], index: int, prefix: str, quant: QuantConfig,
                  dtype: torch.dtype) -> nn.Module:
        num_experts = hf_config.get("num_experts", hf_config.get("num_local_experts", 0))
        step = hf_config.get("decoder_sparse_step", 1)
        if index in hf_config.get("mlp_only_layers", ()) or not num_experts or (index + 1) % step:
            return MLP(self.args, quant, prefix, dtype)
        return SparseMoeMLP(self.args, num_experts, hf_config.get("num_experts_per_tok", 0),
                            hf_config["moe_intermediate_size"], bool(hf_config.get("norm_topk_prob", False)), quant,
                            prefix, dtype)


# Read by engine/models/registry.py, which registers every module of this package that defines ARCHITECTURES.
ARCHITECTURES = {"Qwen3MoeForCausalLM": Qwen3Moe}
