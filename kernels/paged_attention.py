"""The single PagedAttention entry point: write_kv() and paged_attention() over any `AttentionImpl`.

Shapes are checked here once for every implementation, and the FP8 K rotation (kv_scales.py) is applied here (with the K offset), so
implementations see plain queries and keys. Implementations and their names live in kernels/backends.py.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.attention import AttentionImpl, AttentionMetadata, AttentionPlan, check_window
from pagedserve.kernels.kv_cache import LayerKVCache


def _check_kv(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape  # [T, Hkv, D]
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert cache.k.shape[2:] == (num_kv_heads, head_dim), f"cache {tuple(cache.k.shape)} vs key {tuple(key.shape)}"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] @ R as one [T * heads, D] x [D, D] product: `x @ R` on the 3-D view (strided, as the qkv
    projection's slices are) became a batched matmul of T tiny products, ~2x the time of the one GEMM."""
    return (x.reshape(-1, x.shape[-1]) @ rotation.to(x.dtype)).view(x.shape)


def write_kv(
    impl: AttentionImpl, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor
) -> None:
    """Store new K/V ([T, Hkv, D] each) into their cache slots, quantizing when the cache is FP8."""
    _check_kv(key, value, cache, slot_mapping)
    if cache.k_rotation is not None:
        key = rotate(key, cache.k_rotation)
    if cache.k_offset is not None:
        key = key - cache.k_offset.to(key.dtype)  # softmax ignores the per-query shift Q.m (kv_cache.py)
    impl.write_kv(key, value, cache, slot_mapping)


def paged_attention(
    impl: AttentionImpl,
    query: torch.Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    plan: AttentionPlan | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """query [T, H, D] -> output [T, H, D], same dtype as query.

    `window`: the layer's sliding window (None: full causal attention); see kernels/attention.py.
    `plan`: `impl.plan(meta, cache, window)` of this step (the model runner makes one per distinct window and
    step); None plans for this call only, for one-off calls such as tests and benchmarks.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = cache.k.shape[2]
    assert num_tokens == meta.num_tokens, f"query has {num_tokens} tokens, metadata {meta.num_tokens}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} KV heads"
    assert cache.k.shape[3] == head_dim, f"cache head_dim {cache.k.shape[3]} != query head_dim {head_dim}"
    if cache.k_rotation is not None:
        query = rotate(query, cache.k_rotation)  # (Q R).(K R) = Q.K: the cache holds K R
    check_window(window)
    if plan is None:
        plan = impl.plan(meta, cache, window)
    assert plan.window == window, f"plan made for window {plan.window}, layer has window {window}"
    out = impl.attention(query, cache, meta, plan, scale)
    assert out.shape == query.shape and out.dtype == query.dtype
    return out
