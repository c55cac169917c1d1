"""Qwen3 mixture-of-experts models (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): the Qwen3 block whose MLP,
on its sparse layers, is a router over `num_experts` SiLU-gated experts, each token taking `num_experts_per_tok`.

Routing is transformers': a softmax over the router's logits in fp32, the top k kept (renormalised to sum 1 when
`norm_topk_prob`), each chosen expert's output scaled by its weight and added. Layers listed in `mlp_only_layers`, or
off the `decoder_sparse_step` stride, keep a dense MLP of `intermediate_size`. Experts load by the checkpoint's names
(`mlp.experts.N.gate_proj`, ...), so GPTQ/AWQ checkpoints that quantize each expert load as they are. The native decode
step runs dense MLPs only: these models keep the torch path (`decoder_stack` says why).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.models.decoder_stack import DecoderStack, UnsupportedStack
from pagedserve.engine.models.llama import MLP, LlamaArgs
from pagedserve.engine.models.qwen3 import Qwen3
from pagedserve.kernels.layer_ops import LayerOps
from pagedserve.quant.base import QuantConfig
from pagedserve.quant.linear import QuantLinear


class SparseMoeMLP(nn.Module):
    def __init__(self, args: LlamaArgs, num_experts: int, top_k: int, expert_size: int, norm_topk: bool,
                 quant: QuantConfig, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.top_k, self.norm_topk = top_k, norm_topk
        self.gate = QuantLinear(args.hidden_size, num_experts, False, quant.router_method(f"{prefix}.gate"), dtype)
        expert_args = dataclasses.replace(args, intermediate_size=expert_size)
        self.experts = nn.ModuleList(MLP(expert_args, quant, f"{prefix}.experts.{e}", dtype)
                                     for e in range(num_experts))

    def fuse_projections(self) -> None:
        for expert in self.experts:
            expert.fuse_projections()

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """x [T, hidden] -> the weighted sum of each token's chosen experts' outputs."""
        weights, chosen = self.gate(x).float().softmax(dim=-1).topk(self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).flatten()
        order = chosen.flatten().argsort(stable=True)  # the (token, slot) pairs grouped by expert, experts ascending
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        out, start = torch.zeros_like(x), 0
        for expert, count in enumerate(counts):
            if count:
                pairs = order[start:start + count]
                rows = pairs // self.top_k
                out.index_add_(0, rows, self.experts[expert](x[rows], ops) * weights[pairs].unsqueeze(1))
                start += count
        return out


class Qwen3Moe(Qwen3):
    # Which experts run depends on the routing, read on the host each step: no CUDA graph can capture that
    host_reads_in_forward = True

    def build_mlp(self, hf_config: dict[str, Any], index: int, prefix: str, quant: QuantConfig,
                  dtype: torch.dtype) -> nn.Module:
        num_experts = hf_config.get("num_experts", hf_config.get("num_local_experts", 0))
        step = hf_config.get("decoder_sparse_step", 1)
        if index in hf_config.get("mlp_only_layers", ()) or not num_experts or (index + 1) % step:
            return MLP(self.args, quant, prefix, dtype)
        top_k = hf_config.get("num_experts_per_tok", 0)
        if not 0 < top_k <= num_experts:
            raise ModelLoadError(f"num_experts_per_tok {top_k} must be in [1, num_experts = {num_experts}]")
        return SparseMoeMLP(self.args, num_experts, top_k, hf_config["moe_intermediate_size"],
                            bool(hf_config.get("norm_topk_prob", False)), quant, prefix, dtype)

    def decoder_stack(self) -> DecoderStack:
        if any(isinstance(layer.mlp, SparseMoeMLP) for layer in self.model.layers):
            raise UnsupportedStack("mixture-of-experts MLPs: the C step runs dense MLPs")
        return super().decoder_stack()


# Read by engine/models/registry.py, which registers every module of this package that defines ARCHITECTURES.
ARCHITECTURES = {"Qwen3MoeForCausalLM": Qwen3Moe}
