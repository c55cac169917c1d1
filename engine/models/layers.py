"""Building blocks shared by the models: norms, rotary embeddings, sliding windows, the per-step forward context."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedserve.engine.errors import ModelLoadError
from pagedserve.kernels.attention import AttentionImpl, AttentionMetadata, AttentionPlan
from pagedserve.kernels.kv_cache import KVCache
from pagedserve.kernels.layer_ops import LayerOps, TorchLayerOps
from pagedserve.kernels.paged_attention import paged_attention, write_kv
from pagedserve.quant.gguf import PackedEmbedding
from pagedserve.quant.linear import QuantLinear
from pagedserve.quant.unquantized import UnquantizedLinearMethod


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """Everything a layer needs beyond its input for one step; passed explicitly, never global."""

    attn_meta: AttentionMetadata
    kv_cache: KVCache
    attn_impl: AttentionImpl
    layer_ops: LayerOps = TorchLayerOps()
    # attn_impl.plan(attn_meta, ..., window) of this step for each distinct sliding window (None: full attention),
    # made once by the model runner; a window missing here: each layer with it plans for itself.
    attn_plans: Mapping[int | None, AttentionPlan] = field(default_factory=dict)

    def plan_for(self, window: int | None) -> AttentionPlan | None:
        return self.attn_plans.get(window)

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
        """One layer's attention step: its new K/V ([T, Hkv, D]) into its cache, then q [T, H, D] over the cache
        with this step's plan for `window` -> [T, H, D]."""
        cache = self.kv_cache.layers[layer_index]
        write_kv(self.attn_impl, k, v, cache, self.attn_meta.slot_mapping)
        return paged_attention(self.attn_impl, q, cache, self.attn_meta, scale, self.plan_for(window), window)


SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(cfg: dict[str, Any], num_layers: int, pattern: int | None = None) -> tuple[str, ...]:
    """Each layer's attention type from an HF config, as transformers 5 reads it.

    `layer_types` names each layer; without it every layer is sliding (Mistral), or the layers from
    `max_window_layers` on (Qwen2), or, given `pattern` (Gemma's sliding_window_pattern), all but every pattern-th.
    """
    types = cfg.get("layer_types")
    if types is None:
        if pattern is not None and (not isinstance(pattern, int) or pattern < 1):
            raise ModelLoadError(f"sliding_window_pattern: must be a positive integer, got {pattern!r}")
        if pattern is not None:
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
        else:
            first = cfg.get("max_window_layers", 0)
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ModelLoadError(f"layer_types: {types!r}; expected {num_layers} of {SLIDING!r} / {FULL!r}")
    return tuple(types)


def layer_windows(types: tuple[str, ...], window: int | None) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention): `window` for sliding layers, when there is one."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"sliding_window: must be a positive integer or null, got {window!r}")
    return tuple(window if window and t == SLIDING else None for t in types)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual + delta, this norm of it); may update `residual` in place."""
        return ops.add_rms_norm(residual, delta, self.weight, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2], attention scaling factor applied to cos/sin)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    raise ModelLoadError(f"rope_scaling.rope_type: unsupported {rope_type!r}; supported: default, linear, llama3")


@dataclass(frozen=True, slots=True)
class RopeAngles:
    """cos and sign-folded sin for one step's positions, [T, 1, D] in the compute dtype; built once per forward."""

    cos: torch.Tensor
    signed_sin: torch.Tensor  # sin with its first half negated: rotate_half's minus sign, folded in once
    ops: LayerOps

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, N, D] -> RoPE(x), same op order as transformers' (x * cos) + (rotate_half(x) * sin)."""
        return self.ops.rope(x, self.cos, self.signed_sin)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE with cos/sin precomputed for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin() * attention_factor
        half = head_dim // 2
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)  # [P, D]
        self.register_buffer("signed_sin", torch.cat((-sin[:, :half], sin[:, half:]), dim=-1), persistent=False)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype, ops: LayerOps) -> RopeAngles:
        """positions [T] -> the step's RopeAngles, cast to `dtype` as transformers casts cos/sin."""
        return RopeAngles(
            self.cos[positions].to(dtype).unsqueeze(1), self.signed_sin[positions].to(dtype).unsqueeze(1), ops
        )


def merge_linears(owner: nn.Module, parts: tuple[str, ...], merged: str) -> None:
    """After loading: `owner`'s linears named `parts` (one input each: q/k/v, gate/up) become the one linear
    `merged` (outputs concatenated in that order) when their quant method can merge them, and the parts are dropped;
    otherwise all stay as they are and `merged` stays None."""
    linears = [getattr(owner, name) for name in parts]
    fused = linears[0].method.merge(linears)
    if fused is not None:
        setattr(owner, merged, fused)
        for name in parts:
            delattr(owner, name)


def tied_lm_head(embedding: nn.Module) -> nn.Module:
    """The LM head of a model with tied embeddings: a linear layer over the embedding's weight [vocab, hidden], so
    it takes the packed matmul path (on CPU a packed copy; elsewhere the same tensor, shared). An embedding kept in
    a checkpoint's own blocks (`as_linear`) serves the head from those blocks."""
    if isinstance(embedding, PackedEmbedding):
        return embedding.as_linear()
    vocab, hidden = embedding.weight.shape
    with torch.device("meta"):  # no throwaway allocation: the weight is replaced at once
        head = QuantLinear(hidden, vocab, False, UnquantizedLinearMethod(), embedding.weight.dtype)
    head.weight = embedding.weight
    head.weight_shared = True
    return head
