"""Prefill chunks through the native kernel (prefill_attention.c): every sequence of a step with more than one
new token, in one call per layer, reading K/V blocks in place.

The torch path (prefill_attention.py) gathers and upcasts each chunk's blocks and runs SDPA once per sequence and
layer; the native kernel replaces both with one parallel region over (sequence, KV head, 16 query positions).
Head dims that are not a multiple of 16 keep the SDPA path (NativeCpuAttention.plan decides), and so do long chunks
unless bf16 queries over a bf16 cache take AMX tiles here (`amx_prefill`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.kernels.cpu.native import attention_fields, load_library
from pagedserve.kernels.cpu.structs import PrefillArgs
from pagedserve.kernels.kv_cache import LayerKVCache


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """The prefill chunks of one step, as the native kernel reads them. Built once per step, shared by all layers."""

    rows: torch.Tensor  # [S] int64: each chunk's first query row
    query_lens: torch.Tensor  # [S] int32: new tokens (> 1)
    seq_lens: torch.Tensor  # [S] int32: context length including the new tokens
    block_tables: torch.Tensor  # [S, B] int32, contiguous; entries before the window may be -1 (freed)
    window: int | None = None

    def __post_init__(self) -> None:
        n = self.rows.shape[0]
        assert self.rows.dtype == torch.int64 and self.query_lens.dtype == self.seq_lens.dtype == torch.int32
        assert self.query_lens.shape == self.seq_lens.shape == (n,) and self.block_tables.shape[0] == n
        assert self.block_tables.dtype == torch.int32 and self.block_tables.is_contiguous()
        assert self.window is None or self.window >= 1

    @classmethod
    def of(cls, meta: AttentionMetadata, starts: list[int], window: int | None,
           picked: tuple[int, ...]) -> PrefillBatch | None:
        """The step's chunks this kernel computes (`picked`: indices of sequences with more than one new token), or
        None when there are none."""
        if not picked:
            return None
        index = torch.tensor(picked, dtype=torch.long)
        return cls(
            rows=torch.tensor([starts[i] for i in picked], dtype=torch.long),
            query_lens=torch.tensor([meta.query_lens_host[i] for i in picked], dtype=torch.int32),
            seq_lens=meta.seq_lens[index].contiguous(),
            block_tables=meta.block_tables[index].contiguous(),
            window=window,
        )


def amx_prefill(cache: LayerKVCache) -> bool:
    """Whether long chunks of bf16 queries over this cache are worth the kernel's AMX tiles here: a bf16 cache, a head
    dim that is a multiple of 32, a build with AMX and the OS's grant of the tile state. Then the kernel is 0.9-1.4x
    SDPA's speed on long chunks (1.2-1.4x on short ones). Over 8-bit caches it dequantizes each tile once per 16 query
    positions, where SDPA's path dequantizes the chunk's blocks once: long chunks stay there (int8 0.5-0.65x, FP8
    0.7-1.0x of SDPA's speed in the kernel; benchmarks/prefill_attention_ab.py, one thread, noisy)."""
    return cache.k.dtype == torch.bfloat16 and load_library().pagedserve_prefill_amx(cache.k.shape[3]) == 1


def prefill_attention_native(
    query: torch.Tensor, out: torch.Tensor, cache: LayerKVCache, batch: PrefillBatch, scale: float
) -> None:
    """out[chunk rows] = causal attention of each chunk's queries over its cached context and itself; tensors as
    cpu_native.attention_fields takes them, head_dim a multiple of 16."""
    assert query.shape[2] % 16 == 0, f"head_dim {query.shape[2]} is not a multiple of 16"
    fields = attention_fields(query, out, cache, batch, scale)
    args = PrefillArgs(**fields, query_lens=batch.query_lens.data_ptr())
    status = load_library().pagedserve_prefill_attention(
        ctypes.addressof(args), batch.rows.shape[0], torch.get_num_threads()
    )
    if status != 0:
        raise MemoryError("native prefill attention could not allocate its per-thread scratch")
