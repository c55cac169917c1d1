"""The native decode attention's key chunks (kernels/cpu/decode_chunks.h, kernels/cpu/decode_tasks.c): a row's keys are cut
at fixed multiples of the chunk and the chunks' softmax partials merged in order, one task per chunk when a step has
few (span, KV head) pairs per thread. Speculative decoding's greedy exactness needs a row's output to be the same
bits however the step is scheduled: alone or in a batch, in a span with its drafts or not, on 1, 2 or 3 threads."""

from __future__ import annotations

import pytest
import torch

from attention_cases import SCALE, TOLERANCE, float64_reference, make_case
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.kv_cache import KVDtype

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="cases are built on the GPU when one is present")


def _lengths() -> tuple[int, ...]:
    """16 distinct sequences with contexts below, at and above one chunk and across several."""
    c = cpu_native.decode_key_chunk()
    return (c - 1, c, c + 1, 1, 2 * c + 37, 17, 3 * c, 3 * c + 1, c // 2, 5, 2 * c - 1, 40, c + 100, 9, 4 * c + 3, 70)


def _run(query, layer, lens, tables, window, threads: int) -> torch.Tensor:
    out = torch.zeros_like(query)
    batch = cpu_native.DecodeBatch(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.int32), tables,
                                   max(lens), window)
    cpu_native.decode_attention(query, out, layer, batch, SCALE, num_threads=threads)
    return out


@pytest.mark.parametrize(("kv_dtype", "head_dim", "window"), [
    (KVDtype.BF16, 64, None),  # fp32 queries over a bf16 cache, as the native decode step calls it
    (KVDtype.FP8_E4M3, 128, 300),  # a window that starts mid-chunk
    (KVDtype.FP16, 48, None),  # head_dim off the vector code: not chunked
])
def test_a_row_is_the_same_bits_alone_batched_and_on_any_thread_count(kv_dtype, head_dim, window):
    """fp32 outputs where the kernel allows, so that a different summation order cannot hide in a rounding."""
    lens = _lengths()
    query, layer, meta = make_case(lens, (1,) * len(lens), 16, 3, kv_dtype, head_dim, seed=12)
    if kv_dtype is KVDtype.BF16:
        query = query.float()
    batched = _run(query, layer, lens, meta.block_tables, window, 2)  # 32 pairs: a task each, chunks in turn
    assert torch.isfinite(batched).all()
    for threads in (1, 2, 3):  # on 2 and 3 threads a row's 2 pairs are split into a task per chunk
        for r, n in enumerate(lens):
            alone = _run(query[r : r + 1].contiguous(), layer, (n,), meta.block_tables[r : r + 1].contiguous(),
                         window, threads)
            assert torch.equal(alone[0], batched[r]), (threads, n)
    if window is None:
        exact = float64_reference(query, layer, meta)
        assert (batched.double() - exact).abs().max().item() <= TOLERANCE[query.dtype]


@pytest.mark.parametrize("threads", [1, 2])
def test_draft_rows_over_several_chunks_equal_rows_alone(threads):
    """A sequence's row and 4 drafts (one span, one task per KV head, split into chunk tasks on 2 threads) whose
    contexts cross a chunk boundary: each row equals the row alone, whose chunks differ in number."""
    c = cpu_native.decode_key_chunk()
    lens = tuple(2 * c - 2 + i for i in range(5))
    query, layer, meta = make_case((lens[-1],), (1,), 16, 3, KVDtype.BF16, 64, seed=13)
    queries = torch.randn(5, query.shape[1], 64, generator=torch.Generator().manual_seed(2))  # fp32, as the step
    tables = meta.block_tables.expand(5, -1).contiguous()
    together = _run(queries, layer, lens, tables, None, threads)
    for r, n in enumerate(lens):
        alone = _run(queries[r : r + 1].contiguous(), layer, (n,), tables[:1], None, 2 if threads == 1 else 1)
        assert torch.equal(alone[0], together[r]), n
