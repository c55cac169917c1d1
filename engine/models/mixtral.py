"""Mixtral (8x7B, 8x22B): the Mistral block (sliding window where the config sets one) whose every MLP is a router
over `num_local_experts` SiLU-gated experts, each token taking `num_experts_per_tok` with its weights renormalised
(engine/models/moe.py).

The checkpoint names the MLP `block_sparse_moe` and each expert's projections `w1` (gate), `w3` (up) and `w2`
(down); they load into the shared module names through the checkpoint layout, so the experts, their fused gate/up
and the loader are the Qwen3 MoE ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.engine.models.checkpoint_layout import CheckpointLayout
from pagedserve.engine.models.llama import Mistral
from pagedserve.engine.models.moe import SparseMoeMLP
from pagedserve.quant.base import QuantConfig


class Mixtral(Mistral):
    checkpoint_layout = CheckpointLayout(infixes=((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."),
                                                  (".w3.", ".up_proj."), (".w2.", ".down_proj.")))

    def build_mlp(self, hf_config: dict[str, Any], index: int, prefix: str, quant: QuantConfig,
                  dtype: torch.dtype) -> nn.Module:
        return SparseMoeMLP(self.args, hf_config.get("num_local_experts", 0), hf_config.get("num_experts_per_tok", 0),
                            self.args.intermediate_size, True, quant, prefix, dtype)


# Read by engine/models/registry.py, which registers every module of this package that defines ARCHITECTURES.
ARCHITECTURES = {"MixtralForCausalLM": Mixtral}
