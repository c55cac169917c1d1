"""The attention interface every implementation fills: the step's metadata and `AttentionImpl`.

Every implementation (torch, native C on CPU, Triton on CUDA) shares these semantics: queries of all sequences are
packed along dim 0 and located by `query_start_loc`; each sequence's new tokens attend causally to each other and
fully to its cached context. Implementations import only this module (and kv_cache); the registry that names them
is `kernels/backends.py`, the shape-checking entry points are `kernels/paged_attention.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from pagedserve.kernels.kv_cache import LayerKVCache

PlanT = TypeVar("PlanT")


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

    def query_starts(self) -> list[int]:
        """Each sequence's first query row (host copy of query_start_loc, without a device sync)."""
        starts = [0]
        for q_len in self.query_lens_host:
            starts.append(starts[-1] + q_len)
        return starts


class AttentionImpl(ABC, Generic[PlanT]):
    """One implementation of the entry point. Shapes are checked by kernels/paged_attention.py.

    `plan` is called once per step (by the model runner, before the first layer) and its result is handed to every
    layer's `attention` call of that step: index tensors built there are built once, not once per layer. A plan
    depends only on the metadata and the cache geometry (blocks, block size, KV heads), which all layers share.
    """

    @abstractmethod
    def plan(self, meta: AttentionMetadata, cache: LayerKVCache) -> PlanT:
        """The step's plan; `cache` is any layer's cache (only its geometry and device are read)."""

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        """key, value [T, Hkv, D] -> cache slots `slot_mapping` [T], quantized to the cache's dtype."""

    @abstractmethod
    def attention(
        self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, plan: PlanT, scale: float
    ) -> torch.Tensor:
        """query [T, H, D] -> [T, H, D] in query's dtype; `plan` is this step's `plan(meta, ...)`."""
