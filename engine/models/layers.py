"""Building blocks shared by the models: norms, sliding windows, the per-step forward context (rotary embeddings:
rope.py, re-exported here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.models.rope import RopeAngles, RotaryEmbedding  # noqa: F401  (re-exported)
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
    # Each sequence's whole length (every known token, prompt included), in attn_meta's order; None: this step's
    # context lengths stand in. LongRoPE picks its factors by it (a chunked prompt's first chunk is still long).
    seq_lengths: tuple[int, ...] | None = None

    def token_seq_lengths(self, device: torch.device) -> torch.Tensor:
        """[T]: the length of each token's sequence."""
        meta = self.attn_meta
        lengths = self.seq_lengths if self.seq_lengths is not None else meta.seq_lens_host
        return torch.repeat_interleave(torch.tensor(lengths, device=device),
                                       torch.tensor(meta.query_lens_host, device=device))

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

    def per_head(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """x [T, N, head_dim] -> each head normed (Qwen3's q/k norms)."""
        return self(x.reshape(-1, x.shape[-1]), ops).view(x.shape)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual + delta, this norm of it); may update `residual` in place."""
        return ops.add_rms_norm(residual, delta, self.weight, self.eps)


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


def merged_or_parts(owner: nn.Module, parts: tuple[str, ...], merged: str) -> tuple[nn.Module, ...]:
    """What merge_linears left on `owner`: (the merged linear,) where it merged them, else the parts in order."""
    fused = getattr(owner, merged)
    return (fused,) if fused is not None else tuple(getattr(owner, name) for name in parts)


def tied_lm_head(embedding: nn.Module) -> nn.Module:
    """The LM head of a model with tied embeddings: a linear layer over the embedding's weight [vocab, hidden], the
    same tensor (never a oneDNN packed copy beside it: `weight_shared`). An embedding kept in a checkpoint's own
    blocks (`as_linear`) serves the head from those blocks."""
    if isinstance(embedding, PackedEmbedding):
        return embedding.as_linear()
    vocab, hidden = embedding.weight.shape
    table = embedding.weight.dtype
    compute = getattr(embedding, "out_dtype", table)  # a 16-bit table of an fp32 model (DenseEmbedding)
    with torch.device("meta"):  # no throwaway allocation: the weight is replaced at once
        head = QuantLinear(hidden, vocab, False, UnquantizedLinearMethod(None if table == compute else table), compute)
    head.weight = embedding.weight
    head.weight_shared = True
    return head
