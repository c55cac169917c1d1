"""The grouped-rows layout of dense bf16 weights (kernels/cpu/dense_grouped.c) and the embedding that reads it.

Why: the row-major GEMV (kernels/cpu/dense_linear.c) sums each output row across lanes; with 16 rows interleaved one
AVX-512 register holds one input pair's weights for 16 rows, so each activation row costs one FMA per input and
no horizontal sums (1.3-1.9x at one row, 1.5-2.6x at two to eight, on SmolLM2's shapes: docs/quantization.md).
The rewrite is made once at load, in the weight's own storage. A tied LM head shares its weight with the token
embedding, so the layout is marked on the tensor and `DenseEmbedding` reads rows through it: one copy, not two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.cpu.native import load_library

# Rows per group (DENSE_GROUP_ROWS in kernels/cpu/dense_linear.h).
GROUP_ROWS = 16
# Groups rewritten per step of `group_rows_in_place`: bounds its temporary copy (~1 MB for a 576-wide bf16 matrix).
_GROUPS_PER_STEP = 64
# Most bytes of a grouped weight `chunked_linear` turns back to row-major at once. A whole-matrix temporary would be a
# second copy of the weight on every torch-path step, and the allocator keeps freed memory for the next step
# (engine/host/allocator.py): the LM head's 56.6 MB stayed resident beside its table (+0.22x a bf16 SmolLM2).
_LINEAR_CHUNK_BYTES = 4 << 20
# The same for a 16-bit weight widened to fp32 (fp32 bytes): fewer, larger calls, since each widening and each GEMM
# is a parallel region and a busy host makes every region wait on a descheduled thread. A 1B layer's prefill, 2
# shared cores, against fp32 weights held whole: 0.45x / 0.61x (512 / 2048 tokens) in 4 MiB slices, 0.67x / 0.81x
# in 16 MiB, 0.92x / 0.90x in 64 MiB (benchmarks/half_weights_prefill.py, noisy); 64 MiB is 2.6% of a 1B model's
# bf16 bytes, held in the heap between steps (engine/host/allocator.py).
_WIDEN_CHUNK_BYTES = 64 << 20


def grouped_isa() -> str:
    """What the grouped kernel was compiled to here: avx512, avx2, or portable (no grouped kernel: builds without AVX2
    keep the row-major layout and its kernel)."""
    return load_library().pagedserve_dense_grouped_isa().decode()


def row_group(weight: torch.Tensor) -> int:
    """The layout `weight` holds: 0 (row-major) or GROUP_ROWS (`group_rows_in_place` rewrote it)."""
    return getattr(weight, "pagedserve_row_group", 0)


def can_group(weight: torch.Tensor) -> bool:
    """Whether the grouped kernel reads this weight here: a contiguous bf16 [out, in] CPU matrix with out % 16 == 0
    and in even, in an AVX2 or AVX-512 build; other matrices keep the row-major layout."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous() and weight.shape[0] % GROUP_ROWS == 0 and weight.shape[1] % 2 == 0
            and grouped_isa() in ("avx512", "avx2"))


def group_rows_in_place(weight: torch.Tensor) -> None:
    """Rewrites a row-major bf16 [out, in] weight (`can_group`) into the grouped layout in its own storage: group g's
    tile p, 32-bit word l holds row 16g + l's inputs 2p (low half) and 2p + 1. Marks the tensor (`row_group`)."""
    if row_group(weight):
        return
    if not can_group(weight):
        raise ValueError(f"dense layout: cannot group a {tuple(weight.shape)} {weight.dtype} weight here")
    n_in = weight.shape[1]
    with torch.no_grad():
        for r0 in range(0, weight.shape[0], GROUP_ROWS * _GROUPS_PER_STEP):
            rows = weight[r0:r0 + GROUP_ROWS * _GROUPS_PER_STEP]
            tiles = rows.view(-1, GROUP_ROWS, n_in // 2, 2).permute(0, 2, 1, 3).contiguous()
            rows.copy_(tiles.view(rows.shape))
    weight.pagedserve_row_group = GROUP_ROWS


def row_major(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as a row-major [out, in] tensor: itself, or for a grouped one a temporary row-major copy (the torch
    path's matmuls on a weight whose only copy the native kernel regrouped)."""
    if not row_group(weight):
        return weight
    out, n_in = weight.shape
    tiles = weight.view(out // GROUP_ROWS, n_in // 2, GROUP_ROWS, 2)
    return tiles.permute(0, 2, 1, 3).reshape(out, n_in)


def _ungrouped(rows: torch.Tensor) -> torch.Tensor:
    """Whole groups of a grouped weight (a slice of it) as a row-major temporary."""
    n_in = rows.shape[1]
    return rows.view(-1, n_in // 2, GROUP_ROWS, 2).permute(0, 2, 1, 3).reshape(rows.shape)


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, row_major(weight).to(x.dtype), bias) for a grouped weight or a 16-bit one under fp32 compute,
    made row-major and x's dtype at most _LINEAR_CHUNK_BYTES at a time: each output column is the same dot product
    F.linear computes over the whole matrix, and no whole-matrix temporary (a second copy of the weight, kept by the
    allocator) is ever made."""
    out_features, n_in = weight.shape
    limit = _LINEAR_CHUNK_BYTES if weight.dtype == x.dtype else _WIDEN_CHUNK_BYTES
    step = max(GROUP_ROWS, limit // (n_in * x.element_size()) // GROUP_ROWS * GROUP_ROWS)
    if step >= out_features:
        return F.linear(x, row_major(weight).to(x.dtype), bias)
    unpack = _ungrouped if row_group(weight) else (lambda rows: rows)
    parts = [F.linear(x, unpack(weight[r0:r0 + step]).to(x.dtype), None if bias is None else bias[r0:r0 + step])
             for r0 in range(0, out_features, step)]
    return torch.cat(parts, dim=-1)


def embedding_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (1-D) of a [vocab, dim] table in either layout, as the row-major table holds them."""
    if not row_group(weight):
        return F.embedding(ids, weight)
    # A row's input pairs are 32-bit words GROUP_ROWS apart: one flat gather of words, 2.7x the rate of indexing
    # the [groups, pairs, 16, 2] view (8.6 -> 3.2 ms for a 2,016-token prefill over a 49k x 576 table, one thread).
    pairs = weight.shape[1] // 2
    ids = ids.long()
    first = (ids // GROUP_ROWS) * (pairs * GROUP_ROWS) + ids % GROUP_ROWS
    words = weight.view(torch.int32).reshape(-1)[first[:, None] + torch.arange(0, pairs * GROUP_ROWS, GROUP_ROWS)]
    return words.view(weight.dtype).reshape(ids.shape[0], 2 * pairs)


class DenseEmbedding(nn.Module):
    """A token embedding over a plain [vocab, dim] table, row-major or grouped (a tied head's native kernel may
    have grouped it since loading)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, table_dtype: torch.dtype | None = None):
        """dtype: the rows' dtype out (the compute dtype); table_dtype: the table's in memory (default: dtype; a
        16-bit checkpoint's own dtype where the model computes in fp32 without 16-bit arithmetic)."""
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.out_dtype = num_embeddings, embedding_dim, dtype
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=table_dtype or dtype),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = embedding_rows(self.weight, ids.reshape(-1)).to(self.out_dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, grouped={bool(row_group(self.weight))}"
