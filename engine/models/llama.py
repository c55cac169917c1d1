"""The Llama family (Llama 1/2/3, Mistral, Qwen2; Qwen3 and Phi-3 subclass it): one implementation, differences read
from the config and from class attributes the subclasses set (q/k norms, RoPE type aliases, checkpoint layout).

Mistral's, Qwen2's and Phi-3's `sliding_window` is honoured per layer (layers.layer_windows); Llama has none.

Module names match HF checkpoints (model.layers.N.self_attn.q_proj, ...), so weights load by name.
Tokens of all sequences in a step are packed along dim 0: hidden states are [T, hidden].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.models.checkpoint_layout import PLAIN, CheckpointLayout
from pagedserve.engine.models.decoder_stack import DecoderStack, StackLayer, UnsupportedStack
from pagedserve.engine.models.layers import (
    ForwardContext, RMSNorm, layer_types, layer_windows, merge_linears, merged_or_parts, tied_lm_head,
)
from pagedserve.engine.models.rope import RopeAngles, RopeParams, RotaryEmbedding, hf_rope
from pagedserve.kernels.layer_ops import LayerOps
from pagedserve.quant.base import QuantConfig
from pagedserve.quant.linear import QuantLinear


@dataclass(frozen=True, slots=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeParams
    max_position_embeddings: int  # positions the rotary table covers (vLLM's dynamic NTK: factor x the config's)
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    o_bias: bool
    layer_windows: tuple[int | None, ...]  # each layer's sliding window, None: full attention
    qk_norm: bool = False  # Qwen3: an RMSNorm over each q and k head before RoPE

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], qkv_bias: bool, o_bias: bool, sliding: bool, qk_norm: bool = False,
                rope_aliases: dict[str, str] | None = None) -> "LlamaArgs":
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act: {cfg['hidden_act']!r} unsupported; supported: silu")
        num_heads = cfg["num_attention_heads"]
        rope = hf_rope(cfg, aliases=rope_aliases)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=rope,
            max_position_embeddings=rope.table_positions(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=qkv_bias,
            mlp_bias=cfg.get("mlp_bias", False),
            o_bias=o_bias,
            layer_windows=_layer_windows(cfg, sliding),
            qk_norm=qk_norm,
        )


def _layer_windows(cfg: dict[str, Any], sliding: bool) -> tuple[int | None, ...]:
    """Mistral's and Qwen2's per-layer windows (Qwen2 only with use_sliding_window); Llama ignores sliding_window,
    as transformers does."""
    num_layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") if sliding and cfg.get("use_sliding_window", True) is not False else None
    return layer_windows(layer_types(cfg, num_layers), window) if window else (None,) * num_layers


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_index: int, quant: QuantConfig, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.layer_index = layer_index
        self.window = args.layer_windows[layer_index]
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.head_dim**-0.5
        q_out, kv_out = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim

        def linear(name: str, n_in: int, n_out: int, bias: bool) -> QuantLinear:
            return QuantLinear(n_in, n_out, bias, quant.linear_method(f"{prefix}.{name}"), dtype)

        self.q_proj = linear("q_proj", args.hidden_size, q_out, args.qkv_bias)
        self.k_proj = linear("k_proj", args.hidden_size, kv_out, args.qkv_bias)
        self.v_proj = linear("v_proj", args.hidden_size, kv_out, args.qkv_bias)
        self.o_proj = linear("o_proj", q_out, args.hidden_size, args.o_bias)
        self.qkv_proj: nn.Module | None = None
        self.split_sizes = [q_out, kv_out, kv_out]
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, dtype) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, dtype) if args.qk_norm else None

    def fuse_projections(self) -> None:
        merge_linears(self, ("q_proj", "k_proj", "v_proj"), "qkv_proj")

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x -> q [T, H, D], k and v [T, Hkv, D] (views of one fused output where q/k/v are merged)."""
        tokens = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.view(tokens, self.num_heads, self.head_dim), k.view(tokens, self.num_kv_heads, self.head_dim),
                v.view(tokens, self.num_kv_heads, self.head_dim))

    def forward(self, x: torch.Tensor, rope: RopeAngles, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        if self.qkv_proj is not None and self.q_norm is None:
            qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
            q_and_k = qkv[:, : self.split_sizes[0] + self.split_sizes[1]].view(tokens, -1, self.head_dim)
            q, k = rope.rotate(q_and_k).split([self.num_heads, self.num_kv_heads], dim=1)  # one RoPE for both
            v = qkv[:, -self.split_sizes[2] :].reshape(tokens, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = self._project(x)
            if self.q_norm is not None:
                q, k = self.q_norm.per_head(q, ctx.layer_ops), self.k_norm.per_head(k, ctx.layer_ops)
            q, k = rope.rotate(q), rope.rotate(k)
        out = ctx.attend(self.layer_index, q, k, v, self.scale, self.window)  # [T, H, D]
        return self.o_proj(out.reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs, quant: QuantConfig, prefix: str, dtype: torch.dtype):
        super().__init__()
        h, i, b = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = QuantLinear(h, i, b, quant.linear_method(f"{prefix}.gate_proj"), dtype)
        self.up_proj = QuantLinear(h, i, b, quant.linear_method(f"{prefix}.up_proj"), dtype)
        self.down_proj = QuantLinear(i, h, b, quant.linear_method(f"{prefix}.down_proj"), dtype)
        self.gate_up_proj: nn.Module | None = None

    def fuse_projections(self) -> None:
        merge_linears(self, ("gate_proj", "up_proj"), "gate_up_proj")

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, index: int, quant: QuantConfig, dtype: torch.dtype, mlp: nn.Module):
        super().__init__()
        prefix = f"model.layers.{index}"
        self.self_attn = Attention(args, index, quant, f"{prefix}.self_attn", dtype)
        self.mlp = mlp  # the family's: SiLU-gated (MLP), or a mixture of experts (qwen3_moe.py)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(
        self, residual: torch.Tensor, delta: torch.Tensor | None, rope: RopeAngles, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, the previous layer's MLP output not yet added to it; None before the first layer) ->
        the same pair after this layer. Each add is fused into the RMSNorm that follows it, as vLLM does: one pass
        over the stream instead of two, and no separate add op per layer."""
        ops = ctx.layer_ops
        if delta is None:
            h = self.input_layernorm(residual, ops)
        else:
            residual, h = self.input_layernorm.add_forward(residual, delta, ops)
        residual, h = self.post_attention_layernorm.add_forward(residual, self.self_attn(h, rope, ctx), ops)
        return residual, self.mlp(h, ops)


class LlamaBody(nn.Module):
    def __init__(self, args: LlamaArgs, quant: QuantConfig, dtype: torch.dtype,
                 build_mlp: Callable[[int, str], nn.Module]):
        super().__init__()
        self.embed_tokens = quant.embedding("model.embed_tokens", args.vocab_size, args.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(args, i, quant, dtype, build_mlp(i, f"model.layers.{i}.mlp"))
                                    for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    sliding = False  # whether config.json's sliding_window applies (transformers' Llama ignores it)
    qk_norm = False  # q/k RMSNorm per head before RoPE (Qwen3)
    rope_aliases: dict[str, str] = {}  # a family's legacy RoPE type names
    checkpoint_layout: CheckpointLayout = PLAIN  # how checkpoint names differ from module names

    @staticmethod
    def biases(hf_config: dict[str, Any]) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias)."""
        bias = bool(hf_config.get("attention_bias", False))
        return bias, bias

    def __init__(self, hf_config: dict[str, Any], quant: QuantConfig, dtype: torch.dtype):
        super().__init__()
        self.args = args = LlamaArgs.from_hf(hf_config, *self.biases(hf_config), self.sliding, self.qk_norm,
                                             self.rope_aliases)
        self.model = LlamaBody(args, quant, dtype,
                               lambda index, prefix: self.build_mlp(hf_config, index, prefix, quant, dtype))
        self.rotary = RotaryEmbedding(args.head_dim, args.max_position_embeddings, args.rope.theta, args.rope.scaling,
                                      args.rope.partial_rotary_factor)
        if args.tie_word_embeddings and not quant.stores_tied_head():
            self.lm_head = None  # until fuse_projections: the loader must not expect an lm_head.weight
        else:
            self.lm_head = QuantLinear(args.hidden_size, args.vocab_size, False, quant.linear_method("lm_head"), dtype)

    def build_mlp(self, hf_config: dict[str, Any], index: int, prefix: str, quant: QuantConfig,
                  dtype: torch.dtype) -> nn.Module:
        """Layer `index`'s MLP (a family with another MLP overrides this; called while the body is built)."""
        return MLP(self.args, quant, prefix, dtype)

    def fuse_projections(self) -> None:
        """After loading, before linear layers are repacked for their kernels."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        if self.lm_head is None:
            self.lm_head = tied_lm_head(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        lengths = ctx.token_seq_lengths(positions.device) if self.rotary.long_after is not None else None
        rope = self.rotary.angles(positions, x.dtype, ctx.layer_ops, lengths)
        delta = None
        for layer in self.model.layers:
            x, delta = layer(x, delta, rope, ctx)
        if delta is None:  # no layers at all
            return self.model.norm(x, ctx.layer_ops)
        return self.model.norm.add_forward(x, delta, ctx.layer_ops)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> fp32 logits [S, vocab]."""
        return self.lm_head(hidden).float()

    def decoder_stack(self) -> DecoderStack:
        """The layer stack for the native decode step (after fuse_projections)."""
        if self.rotary.rotary_dim != self.args.head_dim:
            raise UnsupportedStack(f"partial rotary ({self.rotary.rotary_dim} of {self.args.head_dim} dimensions): "
                                   "the C step rotates whole heads")
        layers = []
        for index, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(mlp, MLP):
                raise UnsupportedStack(f"layer {index}'s MLP is a {type(mlp).__name__}: the C step runs dense "
                                       "SiLU-gated MLPs")
            layers.append(StackLayer(
                qkv=merged_or_parts(attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                o=attn.o_proj,
                gate_up=merged_or_parts(mlp, ("gate_proj", "up_proj"), "gate_up_proj"),
                down=mlp.down_proj,
                input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                window=attn.window, q_norm=None if attn.q_norm is None else attn.q_norm.weight,
                k_norm=None if attn.k_norm is None else attn.k_norm.weight,
            ))
        args = self.args
        return DecoderStack(
            embedding=self.model.embed_tokens, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
            layers=tuple(layers), final_norm=self.model.norm.weight,
            lm_head=self.lm_head, cos=self.rotary.cos, signed_sin=self.rotary.signed_sin, eps=args.rms_norm_eps,
            num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
            intermediate_size=args.intermediate_size,
            long_rope_after=self.rotary.long_after, long_rope_offset=self.rotary.long_offset,
        )


class Llama(LlamaForCausalLM):
    pass


class Mistral(LlamaForCausalLM):
    sliding = True


class Qwen2(LlamaForCausalLM):
    sliding = True

    @staticmethod
    def biases(hf_config: dict[str, Any]) -> tuple[bool, bool]:
        return True, False  # Qwen2 always has q/k/v biases and never an o_proj bias


# Read by engine/models/registry.py, which registers every module of this package that defines ARCHITECTURES.
ARCHITECTURES = {"LlamaForCausalLM": Llama, "MistralForCausalLM": Mistral, "Qwen2ForCausalLM": Qwen2}
