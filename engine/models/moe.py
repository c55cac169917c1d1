"""The mixture-of-experts MLP the MoE families share (Qwen3 MoE, Mixtral): a router over SiLU-gated experts, each token
taking the top k.

Routing is transformers': a softmax over the router's logits in fp32, the top k kept (renormalised to sum 1 where the
family does), each chosen expert's output scaled by its weight and added. Each expert runs once per step on the rows
that chose it. The router's linear comes from `QuantConfig.router_method` (GPTQ/AWQ tools leave routers unquantized).
Which experts run is read on the host each step (`host_reads_in_forward`: no CUDA graph captures a model with these
layers), and the native decode step runs dense MLPs only (`LlamaForCausalLM.decoder_stack` keeps such a model on the
torch path).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.models.llama import MLP, LlamaArgs
from pagedserve.kernels.layer_ops import LayerOps
from pagedserve.quant.base import QuantConfig
from pagedserve.quant.linear import QuantLinear


class SparseMoeMLP(nn.Module):
    host_reads_in_forward = True  # the routing counts are read on the host, each step (forward's loop)

    def __init__(self, args: LlamaArgs, num_experts: int, top_k: int, expert_size: int, norm_topk: bool,
                 quant: QuantConfig, prefix: str, dtype: torch.dtype):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ModelLoadError(f"{prefix}: num_experts_per_tok {top_k} must be in [1, {num_experts}] (the experts)")
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
