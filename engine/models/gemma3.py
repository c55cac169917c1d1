"""Gemma 3 text decoder (Gemma3ForCausalLM, model_type gemma3_text): sliding-window layers interleaved with global ones.

Differences from Llama, each in transformers' op order: RMSNorm scales by (1 + weight) in fp32 and rounds once at
the end; embeddings are multiplied by sqrt(hidden) rounded to the model dtype; q and k get their own RMSNorm before
RoPE; sliding layers rotate with the local base (rope_local_base_freq) and global ones with rope_theta and its
scaling; the attention scale is query_pre_attn_scalar^-0.5; the MLP is GeGLU (tanh GELU); both sublayer outputs are
normed again before their residual add; the logits may be tanh-softcapped. Module names match the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.models.checkpoint_layout import CheckpointLayout
from pagedserve.engine.models.decoder_stack import DecoderStack, StackLayer, UnsupportedStack
from pagedserve.engine.models.layers import (
    FULL, SLIDING, ForwardContext, layer_types, layer_windows, merge_linears, merged_or_parts, tied_lm_head,
)
from pagedserve.engine.models.rope import RopeAngles, RopeParams, RotaryEmbedding, hf_rope
from pagedserve.quant.base import QuantConfig
from pagedserve.quant.linear import QuantLinear

# Gemma3TextConfig's defaults, for config.json files that leave a key out.
_DEFAULT_WINDOW, _DEFAULT_PATTERN = 4096, 6
_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def _rope(cfg: dict[str, Any], kind: str) -> RopeParams:
    """The rotary embedding of one layer type: transformers 5's `rope_parameters` keyed by layer type, or the
    older rope_theta + rope_scaling (global) and rope_local_base_freq (sliding) keys."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(kind), dict):
        rope = params[kind]
    elif kind == SLIDING:
        rope = {"rope_theta": cfg.get("rope_local_base_freq", _DEFAULT_THETA[SLIDING])}
    else:
        rope = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", _DEFAULT_THETA[FULL])}
    return hf_rope(cfg, rope={"rope_theta": _DEFAULT_THETA[kind], **rope})


@dataclass(frozen=True, slots=True)
class Gemma3Args:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    layer_types: tuple[str, ...]
    layer_windows: tuple[int | None, ...]  # each layer's sliding window, None: full attention
    rope: dict[str, RopeParams]  # layer type -> its rotary embedding

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Gemma3Args":
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ModelLoadError(f"hidden_activation: {act!r} unsupported; supported: gelu_pytorch_tanh")
        if cfg.get("attn_logit_softcapping") is not None:
            raise ModelLoadError("attn_logit_softcapping: unsupported (Gemma 3 has none; Gemma 2 is not implemented)")
        if cfg.get("use_bidirectional_attention"):
            raise ModelLoadError("use_bidirectional_attention: unsupported; pagedserve serves causal decoders")
        num_layers, num_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", _DEFAULT_PATTERN))
        types = layer_types(cfg, num_layers, pattern)
        return cls(
            vocab_size=cfg.get("vocab_size", 262_208),
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim", 256),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 131_072),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            attention_bias=bool(cfg.get("attention_bias", False)),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            layer_types=types,
            layer_windows=layer_windows(types, cfg.get("sliding_window", _DEFAULT_WINDOW)),
            rope={kind: _rope(cfg, kind) for kind in sorted(set(types))},
        )


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in fp32, rounded to x's dtype once at the end (Llama rounds before the weight)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def _linear(quant: QuantConfig, prefix: str, n_in: int, n_out: int, bias: bool, dtype: torch.dtype) -> QuantLinear:
    return QuantLinear(n_in, n_out, bias, quant.linear_method(prefix), dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, args: Gemma3Args, index: int, quant: QuantConfig, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.layer_index = index
        self.window = args.layer_windows[index]
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.query_pre_attn_scalar**-0.5
        q_out, kv_out, bias = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim, args.attention_bias
        self.q_proj = _linear(quant, f"{prefix}.q_proj", args.hidden_size, q_out, bias, dtype)
        self.k_proj = _linear(quant, f"{prefix}.k_proj", args.hidden_size, kv_out, bias, dtype)
        self.v_proj = _linear(quant, f"{prefix}.v_proj", args.hidden_size, kv_out, bias, dtype)
        self.o_proj = _linear(quant, f"{prefix}.o_proj", q_out, args.hidden_size, bias, dtype)
        self.q_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps, dtype)
        self.qkv_proj: nn.Module | None = None
        self.split_sizes = [q_out, kv_out, kv_out]

    def fuse_projections(self) -> None:
        merge_linears(self, ("q_proj", "k_proj", "v_proj"), "qkv_proj")

    def forward(self, x: torch.Tensor, rope: RopeAngles, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = rope.rotate(self.q_norm(q.reshape(tokens, self.num_heads, self.head_dim)))
        k = rope.rotate(self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim)))
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        out = ctx.attend(self.layer_index, q, k, v, self.scale, self.window)  # [T, H, D]
        return self.o_proj(out.reshape(tokens, -1))


class Gemma3MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, args: Gemma3Args, quant: QuantConfig, prefix: str, dtype: torch.dtype):
        super().__init__()
        h, i = args.hidden_size, args.intermediate_size
        self.gate_proj = _linear(quant, f"{prefix}.gate_proj", h, i, False, dtype)
        self.up_proj = _linear(quant, f"{prefix}.up_proj", h, i, False, dtype)
        self.down_proj = _linear(quant, f"{prefix}.down_proj", i, h, False, dtype)
        self.gate_up_proj: nn.Module | None = None

    def fuse_projections(self) -> None:
        merge_linears(self, ("gate_proj", "up_proj"), "gate_up_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, args: Gemma3Args, index: int, quant: QuantConfig, dtype: torch.dtype):
        super().__init__()
        prefix = f"model.layers.{index}"
        self.layer_type = args.layer_types[index]
        self.self_attn = Gemma3Attention(args, index, quant, f"{prefix}.self_attn", dtype)
        self.mlp = Gemma3MLP(args, quant, f"{prefix}.mlp", dtype)
        norm = lambda: GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, x: torch.Tensor, ropes: dict[str, RopeAngles], ctx: ForwardContext) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), ropes[self.layer_type], ctx)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Body(nn.Module):
    def __init__(self, args: Gemma3Args, quant: QuantConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = quant.embedding("model.embed_tokens", args.vocab_size, args.hidden_size, dtype)
        # sqrt(hidden) rounded to the model dtype, as transformers multiplies it (55.4256 becomes 55.5 in bf16).
        self.register_buffer("embed_scale", torch.tensor(args.hidden_size**0.5).to(dtype), persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(args, i, quant, dtype) for i in range(args.num_layers))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, hf_config: dict[str, Any], quant: QuantConfig, dtype: torch.dtype):
        super().__init__()
        self.args = args = Gemma3Args.from_hf(hf_config)
        self.model = Gemma3Body(args, quant, dtype)
        self.rotary = nn.ModuleDict({
            kind: RotaryEmbedding(args.head_dim, args.max_position_embeddings, rope.theta, rope.scaling,
                                  rope.partial_rotary_factor)
            for kind, rope in args.rope.items()
        })
        if args.tie_word_embeddings and not quant.stores_tied_head():
            self.lm_head = None  # until fuse_projections: the loader must not expect an lm_head.weight
        else:
            self.lm_head = _linear(quant, "lm_head", args.hidden_size, args.vocab_size, False, dtype)

    def fuse_projections(self) -> None:
        """After loading, before linear layers are repacked for their kernels."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        if self.lm_head is None:  # tied: over the embedding as stored (unscaled)
            self.lm_head = tied_lm_head(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids) * self.model.embed_scale
        lengths = ctx.token_seq_lengths(positions.device) if any(
            r.long_after is not None for r in self.rotary.values()) else None
        ropes = {kind: rotary.angles(positions, x.dtype, ctx.layer_ops, lengths)
                 for kind, rotary in self.rotary.items()}
        for layer in self.model.layers:
            x = layer(x, ropes, ctx)
        return self.model.norm(x)

    def decoder_stack(self) -> DecoderStack:
        """The layer stack for the native decode step (after fuse_projections). Each (1 + w) norm is handed over as
        the fp32 table 1 + w, the factor GemmaRMSNorm multiplies by in fp32 (the C step keeps its rows fp32)."""
        if any(r.rotary_dim != self.args.head_dim or r.long_after is not None for r in self.rotary.values()):
            raise UnsupportedStack("partial rotary or LongRoPE tables: the C step rotates whole heads from one table")
        norm = lambda module: (1.0 + module.weight.float()).contiguous()  # noqa: E731
        full = self.rotary[FULL] if FULL in self.rotary else next(iter(self.rotary.values()))
        layers = []
        for layer in self.model.layers:
            attn, mlp, rope = layer.self_attn, layer.mlp, self.rotary[layer.layer_type]
            layers.append(StackLayer(
                qkv=merged_or_parts(attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                o=attn.o_proj,
                gate_up=merged_or_parts(mlp, ("gate_proj", "up_proj"), "gate_up_proj"),
                down=mlp.down_proj,
                input_norm=norm(layer.input_layernorm), post_norm=norm(layer.pre_feedforward_layernorm),
                window=attn.window, q_norm=norm(attn.q_norm), k_norm=norm(attn.k_norm),
                attn_out_norm=norm(layer.post_attention_layernorm), mlp_out_norm=norm(layer.post_feedforward_layernorm),
                cos=None if rope is full else rope.cos, signed_sin=None if rope is full else rope.signed_sin,
            ))
        args = self.args
        return DecoderStack(
            embedding=self.model.embed_tokens, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
            layers=tuple(layers), final_norm=norm(self.model.norm), lm_head=self.lm_head,
            cos=full.cos, signed_sin=full.signed_sin, eps=args.rms_norm_eps, num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, intermediate_size=args.intermediate_size,
            attn_scale=args.query_pre_attn_scalar**-0.5, embed_scale=self.model.embed_scale, activation="gelu_tanh",
            logit_softcap=args.final_logit_softcapping,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> fp32 logits [S, vocab], tanh-softcapped when the config says so."""
        logits = self.lm_head(hidden)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 4B/12B/27B as published (image-text checkpoints): the text decoder of `text_config`, its weights
    under transformers 5's `model.language_model.` or transformers 4's `language_model.model.` prefix; the vision
    tower and projector are not loaded (text prompts only)."""

    checkpoint_layout = CheckpointLayout(
        renames=(("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head.")),
        skipped=("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector."),
    )

    def __init__(self, hf_config: dict[str, Any], quant: QuantConfig, dtype: torch.dtype):
        text = hf_config.get("text_config")
        if not isinstance(text, dict):
            raise ModelLoadError("text_config: missing; a Gemma3ForConditionalGeneration config nests the text model")
        # The head is tied unless the top level says otherwise (transformers reads it there for this class).
        super().__init__({"tie_word_embeddings": hf_config.get("tie_word_embeddings", True), **text}, quant, dtype)


# Read by engine/models/registry.py, which registers every module of this package that defines ARCHITECTURES.
ARCHITECTURES = {"Gemma3ForCausalLM": Gemma3ForCausalLM,
                 "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration}
