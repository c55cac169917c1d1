"""The single PagedAttention entry point: write_kv() and paged_attention(), dispatched by a typed registry.

Every implementation (torch, native C on CPU, Triton on CUDA) shares these signatures and semantics:
queries of all sequences are packed along dim 0 and located by `query_start_loc`; each sequence's new
tokens attend causally to each other and fully to its cached context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pagedserve.kernels.kv_cache import LayerKVCache
from pagedserve.kernels.registry import Registry

@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where each sequence's tokens live. Built once per step by the model runner, shared by all layers."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: seq i's new tokens are rows [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # [num_seqs] int32: cached context + new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, unused entries 0
    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset for each new token
    max_query_len: int
    max_seq_len: int
    # Host copies: the torch path plans its work from these without device syncs.
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]

    def __post_init__(self) -> None:
        n = self.seq_lens.shape[0]
        assert self.query_start_loc.shape == (n + 1,), "query_start_loc must be [num_seqs + 1]"
        assert self.block_tables.dim() == 2 and self.block_tables.shape[0] == n, "block_tables must be [num_seqs, B]"
        assert len(self.query_lens_host) == n and len(self.seq_lens_host) == n
        assert self.query_start_loc.dtype == torch.int32 and self.seq_lens.dtype == torch.int32
        assert self.block_tables.dtype == torch.int32 and self.slot_mapping.dtype == torch.int64

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionImpl(ABC):
    """One implementation of the entry point. Shapes are checked by the module-level wrappers."""

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        ...

    @abstractmethod
    def attention(
        self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        ...


ATTENTION_IMPLS: Registry[type[AttentionImpl]] = Registry("attention implementation")


def select_attention_impl(name: str, device: torch.device) -> AttentionImpl:
    """`auto` picks Triton on CUDA (when importable), the native CPU kernels on CPU (when they build here) and
    torch otherwise; other names are explicit."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if "triton" in ATTENTION_IMPLS else "torch"
        else:
            name = "native" if device.type == "cpu" and cpu_native.available() else "torch"
    return ATTENTION_IMPLS.get(name)()


def _check_kv(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape  # [T, Hkv, D]
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert cache.k.shape[2:] == (num_kv_heads, head_dim), f"cache {tuple(cache.k.shape)} vs key {tuple(key.shape)}"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64


def write_kv(
    impl: AttentionImpl, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor
) -> None:
    """Store new K/V ([T, Hkv, D] each) into their cache slots, quantizing when the cache is FP8."""
    _check_kv(key, value, cache, slot_mapping)
    if cache.k_rotation is not None:
        key = key @ cache.k_rotation.to(key.dtype)
    impl.write_kv(key, value, cache, slot_mapping)


def paged_attention(
    impl: AttentionImpl, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """query [T, H, D] -> output [T, H, D], same dtype as query."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = cache.k.shape[2]
    assert num_tokens == meta.num_tokens, f"query has {num_tokens} tokens, metadata {meta.num_tokens}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not a multiple of {num_kv_heads} KV heads"
    assert cache.k.shape[3] == head_dim, f"cache head_dim {cache.k.shape[3]} != query head_dim {head_dim}"
    if cache.k_rotation is not None:
        query = query @ cache.k_rotation.to(query.dtype)  # (Q R).(K R) = Q.K: the cache holds K R
    out = impl.attention(query, cache, meta, scale)
    assert out.shape == query.shape and out.dtype == query.dtype
    return out


# Importing the implementations registers them.
from pagedserve.kernels import cpu_native  # noqa: E402
from pagedserve.kernels import torch_attention  # noqa: E402,F401
from pagedserve.kernels import native_attention  # noqa: E402,F401
from pagedserve.kernels import triton_backend  # noqa: E402,F401  (registers "triton" only if installed)
