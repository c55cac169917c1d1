"""The attention interface every implementation fills: the step's metadata and `AttentionImpl`.

Every implementation (torch, native C on CPU, Triton on CUDA) shares these semantics: queries of all sequences are
packed along dim 0 and located by `query_start_loc`; each sequence's new tokens attend causally to each other and
to its cached context. A layer with a sliding window W (Mistral, Gemma's local layers) shows the query at absolute
position p only the keys at positions p - W < k <= p (transformers' `sliding_window_overlay`: kv > q - W); the
window is a property of the step's plan, made once per distinct window. Block-table entries of blocks that hold no
key any query can see may be -1 (the block manager freed them), so implementations read only blocks that hold
visible keys. Implementations import only this module (and kv_cache); the registry that names them is
`kernels/backends.py`, the shape-checking entry points are `kernels/paged_attention.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from pagedserve.kernels.kv_cache import LayerKVCache
from pagedserve.kernels.requirements import Requirements

PlanT = TypeVar("PlanT", bound="AttentionPlan")


def first_visible_key(position: int, window: int | None) -> int:
    """The earliest key position a query at `position` (or any later one) can see through `window`."""
    return 0 if window is None else max(0, position - window + 1)


def check_window(window: int | None) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding window must be None or a positive int, got {window!r}")


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where each sequence's tokens live. Built once per step by the model runner, shared by all layers."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: seq i's new tokens are rows [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # [num_seqs] int32: cached context + new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, unused entries 0, freed ones -1
    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset for each new token
    max_query_len: int
    max_seq_len: int
    # Host copies: the torch path plans its work from these without device syncs. A CUDA graph's metadata holds
    # max_model_len in max_seq_len and seq_lens_host (upper bounds; seq_lens is exact): see AttentionImpl.cuda_graphs.
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


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """What every implementation's per-step plan carries: the sliding window it was made for (None: full)."""

    window: int | None


class AttentionImpl(ABC, Generic[PlanT]):
    """One implementation of the entry point. Shapes are checked by kernels/paged_attention.py.

    `plan` is called once per step (by the model runner, before the first layer) and its result is handed to every
    layer's `attention` call of that step: index tensors built there are built once, not once per layer. A plan
    depends only on the metadata, the cache geometry (blocks, block size, KV heads), which all layers share, and
    the sliding window, which layers share in groups (one plan per distinct window).
    """

    requirements: ClassVar[Requirements] = Requirements()  # checked against the engine config at startup

    def cuda_graphs(self) -> bool:
        """Whether a one-token-per-sequence step through this implementation may be captured into a CUDA graph now
        and replayed for later steps of the same number of sequences (engine/runner/cuda_graphs.py): no host sync,
        launches sized only by num_seqs, num_tokens and max_query_len (a graph's metadata holds max_seq_len and
        seq_lens_host as upper bounds: max_model_len), no state that a later write changes, and KV writes that skip
        negative slots (padded rows). False unless an implementation says so."""
        return False

    @abstractmethod
    def plan(self, meta: AttentionMetadata, cache: LayerKVCache, window: int | None = None) -> PlanT:
        """The step's plan for layers with this sliding `window` (None: full attention); `cache` is any layer's
        cache (only its geometry and device are read)."""

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        """key, value [T, Hkv, D] -> cache slots `slot_mapping` [T], quantized to the cache's dtype."""

    @abstractmethod
    def attention(
        self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, plan: PlanT, scale: float
    ) -> torch.Tensor:
        """query [T, H, D] -> [T, H, D] in query's dtype; `plan` is this step's `plan(meta, ..., window)`."""


class WriteObservingAttention(AttentionImpl[Any]):
    """An implementation wrapped to look at (or set scales from) what is written: `write_kv` is the subclass's,
    which ends by calling `inner.write_kv`; plans and attention are `inner`'s own."""

    def __init__(self, inner: AttentionImpl):
        self.inner = inner

    def plan(self, meta: AttentionMetadata, cache: LayerKVCache, window: int | None = None) -> Any:
        return self.inner.plan(meta, cache, window)

    def attention(
        self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, plan: Any, scale: float
    ) -> torch.Tensor:
        return self.inner.attention(query, cache, meta, plan, scale)
