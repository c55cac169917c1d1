"""What a model hands the native decode step (engine/runner/native_step.py): its layer stack as tensors and linears.

A model family whose decode step is the Llama layer (RMSNorm, q/k/v, optional per-head q/k RMSNorms, rotate-half
RoPE over whole heads, paged attention, o projection, RMSNorm, SiLU-gated MLP, residual adds) defines
`decoder_stack()` returning this (raising `UnsupportedStack` where one model of the family does not fit: partial
rotary); families with other layer math (Gemma 3: (1 + w) norms, GeGLU, softcapping) define none and keep the torch
path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.quant.linear import QuantLinear


class UnsupportedStack(Exception):
    """Why a model's layer math does not fit the native step (it keeps the torch path; logged, never raised to
    the user)."""


@dataclass(frozen=True, slots=True)
class StackLayer:
    qkv: tuple[QuantLinear, ...]  # one merged q/k/v linear, or q, k, v (outputs concatenated in that order)
    o: QuantLinear
    gate_up: tuple[QuantLinear, ...]  # one merged [gate | up] linear, or gate, up
    down: QuantLinear
    input_norm: torch.Tensor  # [hidden] RMSNorm weights
    post_norm: torch.Tensor
    window: int | None  # sliding window; None: full attention
    q_norm: torch.Tensor | None = None  # [head_dim] RMSNorm weights of each q / k head before RoPE (Qwen3)
    k_norm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("StackLayer: q_norm and k_norm come together")
        if len(self.qkv) not in (1, 3) or len(self.gate_up) not in (1, 2):
            raise ValueError(f"StackLayer: qkv has {len(self.qkv)} parts (1 or 3), "
                             f"gate_up {len(self.gate_up)} (1 or 2)")


@dataclass(frozen=True, slots=True)
class DecoderStack:
    embedding: nn.Module  # token ids [n] -> rows [n, hidden] (dense, or kept in a checkpoint's blocks)
    vocab_size: int
    hidden_size: int
    layers: tuple[StackLayer, ...]
    final_norm: torch.Tensor  # [hidden]
    lm_head: QuantLinear
    cos: torch.Tensor  # [table rows, head_dim] fp32 (attention factor applied; rows: rope_row)
    signed_sin: torch.Tensor  # same, sin's first half negated
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    # LongRoPE: a sequence longer than this reads the table's rows from long_rope_offset on (rope.py); None: one set
    long_rope_after: int | None = None
    long_rope_offset: int = 0

    def rope_row(self, position: int, seq_length: int) -> int:
        """The cos/sin table row of a token at `position` of a sequence of `seq_length` tokens."""
        if self.long_rope_after is not None and seq_length > self.long_rope_after:
            return position + self.long_rope_offset
        return position

    def __post_init__(self) -> None:
        if self.cos.dtype != torch.float32 or self.cos.shape != self.signed_sin.shape:
            raise ValueError("DecoderStack: cos and signed_sin must be fp32 tables of one shape")
        if self.cos.shape[1] != self.head_dim or self.num_heads % self.num_kv_heads:
            raise ValueError(f"DecoderStack: head_dim {self.head_dim} / heads {self.num_heads}x{self.num_kv_heads}")

    @property
    def linears(self) -> tuple[QuantLinear, ...]:
        every = [self.lm_head]
        for layer in self.layers:
            every += [*layer.qkv, layer.o, *layer.gate_up, layer.down]
        return tuple(every)
