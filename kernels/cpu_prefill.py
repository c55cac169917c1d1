"""Prefill chunks through the native kernel (cpu_prefill_attention.c): every sequence of a step with more than one
new token, in one call per layer, reading K/V blocks in place.

The torch path (prefill_attention.py) gathers and upcasts each chunk's blocks and runs SDPA once per sequence and
layer; the native kernel replaces both with one parallel region over (sequence, KV head, 16 query positions).
Head dims that are not a multiple of 16 keep the SDPA path (NativeCpuAttention.plan decides).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.kernels.cpu_native import COMPUTE_DTYPES, _DecodeArgs, dtype_code, load_library


def _prefill_fields() -> list[tuple[str, type]]:
    """PrefillArgs in cpu_prefill_attention.c is DecodeArgs with each chunk's query_lens after rows."""
    fields = list(_DecodeArgs._fields_)
    fields.insert([name for name, _ in fields].index("rows") + 1, ("query_lens", ctypes.c_void_p))
    return fields


class _PrefillArgs(ctypes.Structure):
    _fields_ = _prefill_fields()


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
    def of(cls, meta: AttentionMetadata, starts: list[int], window: int | None) -> PrefillBatch | None:
        """The chunks of a step (sequences with more than one new token), or None when there are none."""
        picked = [i for i, q_len in enumerate(meta.query_lens_host) if q_len > 1]
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


def prefill_attention_native(
    query: torch.Tensor,
    out: torch.Tensor,
    k_storage: torch.Tensor,
    v_storage: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    batch: PrefillBatch,
    scale: float,
) -> None:
    """out[chunk rows] = causal attention of each chunk's queries over its cached context and itself. Same tensor
    contract as cpu_native.decode_attention; head_dim must be a multiple of 16."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, num_blocks, block_size, _ = k_storage.shape
    assert head_dim % 16 == 0, f"head_dim {head_dim} is not a multiple of 16"
    assert query.stride(2) == 1 and query.stride(1) == head_dim and out.is_contiguous() and out.shape == query.shape
    assert query.dtype in COMPUTE_DTYPES and out.dtype == query.dtype, f"query dtype {query.dtype} unsupported"
    assert k_storage.is_contiguous() and v_storage.is_contiguous() and v_storage.shape == k_storage.shape
    assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.shape == v_scale.shape == (num_kv_heads,)
    args = _PrefillArgs(
        query.data_ptr(), query.stride(0), out.data_ptr(), dtype_code(query.dtype),
        k_storage.data_ptr(), v_storage.data_ptr(), dtype_code(k_storage.dtype),
        k_scale.data_ptr(), v_scale.data_ptr(),
        batch.block_tables.data_ptr(), batch.block_tables.stride(0),
        batch.seq_lens.data_ptr(), batch.rows.data_ptr(), batch.query_lens.data_ptr(),
        num_heads, num_kv_heads, head_dim, num_blocks, block_size, scale, batch.window or 0,
    )
    status = load_library().pagedserve_prefill_attention(
        ctypes.addressof(args), batch.rows.shape[0], torch.get_num_threads()
    )
    if status != 0:
        raise MemoryError("native prefill attention could not allocate its per-thread scratch")
