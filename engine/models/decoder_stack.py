"""What a model hands the native decode step (engine/runner/native_step.py): its layer stack as tensors and linears.

A model family whose decode step is the Llama layer (RMSNorm, q/k/v, optional per-head q/k RMSNorms, rotate-half
RoPE over whole heads, paged attention, o projection, RMSNorm, SiLU-gated MLP, residual adds) defines
`decoder_stack()` returning this (raising `UnsupportedStack` where one model of the family does not fit: partial
rotary). Gemma 3's variations are fields: norms of each sublayer's output before its residual add, a RoPE table per
layer (sliding and global layers rotate with different bases), a GELU-gated MLP, an attention scale of its own,
scaled embeddings and softcapped logits; its (1 + w) norm weights are handed over as fp32 tables already holding
1 + w, which is exactly what its RMSNorm multiplies by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.quant.linear import QuantLinear


ACTIVATIONS = ("silu", "gelu_tanh")  # index = StepModel.activation in kernels/cpu/decode_step.c


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
    # [hidden] RMSNorms of the attention's and the MLP's outputs before their residual adds (Gemma 3's post-attention
    # and post-feedforward norms); input_norm / post_norm are then the norms before each sublayer
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    cos: torch.Tensor | None = None  # this layer's own RoPE table (DecoderStack.cos's shape); None: the stack's
    signed_sin: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for first, second in (("q_norm", "k_norm"), ("attn_out_norm", "mlp_out_norm"), ("cos", "signed_sin")):
            if (getattr(self, first) is None) != (getattr(self, second) is None):
                raise ValueError(f"StackLayer: {first} and {second} come together")
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
    attn_scale: float | None = None  # softmax scale of the scores; None: head_dim^-0.5
    embed_scale: torch.Tensor | None = None  # a 0-d tensor the embedding rows are multiplied by in their own dtype
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    logit_softcap: float | None = None  # logits become tanh(logits / cap) * cap

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
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"DecoderStack: activation {self.activation!r}; supported: {', '.join(ACTIVATIONS)}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"DecoderStack: logit_softcap {self.logit_softcap} must be positive")
        if any(t.dtype != self.final_norm.dtype for t in self.norms):
            raise ValueError("DecoderStack: every RMSNorm weight must have the final norm's dtype")
        for layer in self.layers:
            if layer.cos is not None and (layer.cos.dtype != torch.float32 or layer.cos.shape != self.cos.shape
                                          or layer.signed_sin.shape != self.cos.shape):
                raise ValueError("DecoderStack: a layer's RoPE table must be fp32 in the stack's table shape")

    @property
    def norms(self) -> tuple[torch.Tensor, ...]:
        """Every RMSNorm weight the C step reads (in one dtype: StepModel.norm_dtype)."""
        every = [self.final_norm]
        for layer in self.layers:
            every += [t for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm,
                                  layer.attn_out_norm, layer.mlp_out_norm) if t is not None]
        return tuple(every)

    @property
    def linears(self) -> tuple[QuantLinear, ...]:
        every = [self.lm_head]
        for layer in self.layers:
            every += [*layer.qkv, layer.o, *layer.gate_up, layer.down]
        return tuple(every)
