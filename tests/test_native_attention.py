"""The native CPU attention backend (kernels/cpu/*_attention.c) against the torch implementation and float64 math:
the backend `auto` picks on CPU, decode at each ISA tier, and draft rows that must equal rows alone.

The C file is compiled here, on first use, exactly as the engine compiles it; a machine without a C compiler
fails these tests rather than skipping them, because `auto` would silently serve the slower torch path there.
"""

from __future__ import annotations

import pytest
import torch

import cpu_tiers

from attention_cases import (
    BATCHES,
    SCALE,
    TOLERANCE,
    assert_matches_torch,
    float64_reference,
    make_case,
    poison_stale_slots,
)
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.build import load
from pagedserve.kernels.kv_cache import KVDtype
from pagedserve.kernels.native_attention import NativeCpuAttention
from pagedserve.kernels.backends import select_attention_impl
from pagedserve.kernels.paged_attention import paged_attention
from pagedserve.kernels.torch_attention import TorchAttention

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="cases are built on the GPU when one is present")


def run_both(query, layer, meta) -> tuple[torch.Tensor, torch.Tensor]:
    reference = paged_attention(select_attention_impl("torch", CPU), query, layer, meta, SCALE)
    return reference, paged_attention(NativeCpuAttention(), query, layer, meta, SCALE)


def test_auto_picks_native_on_cpu() -> None:
    assert cpu_native.available()
    assert isinstance(select_attention_impl("auto", CPU), NativeCpuAttention)


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("queries_per_kv", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(
    "kv_dtype", [KVDtype.FP32, KVDtype.FP16, KVDtype.BF16, KVDtype.FP8_E4M3, KVDtype.FP8_E5M2]
)
def test_matches_torch_path(batch: str, queries_per_kv: int, block_size: int, kv_dtype: KVDtype) -> None:
    seq_lens, query_lens = BATCHES[batch]
    query, layer, meta = make_case(seq_lens, query_lens, block_size, queries_per_kv, kv_dtype)
    assert_matches_torch(NativeCpuAttention(), query, layer, meta)


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP32, KVDtype.BF16, KVDtype.FP8_E4M3])
def test_agrees_with_float64_math(kv_dtype: KVDtype) -> None:
    """Guards against the two paths sharing one mistake; head_dim 128 and long contexts included."""
    seq_lens = (1, 300, 77, 129)
    query, layer, meta = make_case(seq_lens, (1,) * 4, 16, 3, kv_dtype, head_dim=128, seed=5)
    exact = float64_reference(query, layer, meta)
    tolerance = 1e-5 if kv_dtype is KVDtype.FP32 else TOLERANCE[query.dtype]
    result = paged_attention(NativeCpuAttention(), query, layer, meta, SCALE)
    assert (result.double() - exact).abs().max().item() <= tolerance


@pytest.mark.parametrize("tier", cpu_tiers.params(cpu_tiers.CORE))
@pytest.mark.parametrize("kv_dtype", [KVDtype.FP32, KVDtype.BF16, KVDtype.FP16, KVDtype.FP8_E4M3, KVDtype.INT8])
@pytest.mark.parametrize(("queries_per_kv", "head_dim"), [(3, 64), (8, 128), (1, 80)])
def test_decode_at_each_tier_agrees_with_float64_math(tier, kv_dtype, queries_per_kv, head_dim, monkeypatch) -> None:
    """Decode at each ISA tier: AVX2 has its own values loops (16 dims a pass), key sums and lane comparisons
    (kernels/cpu/lanes.h); 8 queries per KV head take two passes over V, contexts past one 512-key chunk."""
    tier_library = cpu_native.load_library(tier)
    monkeypatch.setattr(cpu_native, "load_library", lambda *_: tier_library)
    query, layer, meta = make_case((1, 600, 77, 129), (1,) * 4, 16, queries_per_kv, kv_dtype, head_dim=head_dim,
                                   seed=head_dim + queries_per_kv)
    exact = float64_reference(query, layer, meta)
    tolerance = 1e-5 if kv_dtype is KVDtype.FP32 else TOLERANCE[query.dtype]
    result = paged_attention(NativeCpuAttention(), query, layer, meta, SCALE)
    assert (result.double() - exact).abs().max().item() <= tolerance


def test_with_hadamard_rotated_keys() -> None:
    seq_lens, query_lens = BATCHES["mixed"]
    query, layer, meta = make_case(seq_lens, query_lens, 16, 3, KVDtype.FP8_E4M3, seed=4, rotate=True)
    reference, result = run_both(query, layer, meta)
    assert (result.float() - reference.float()).abs().max().item() <= TOLERANCE[query.dtype]


def test_strided_query_rows() -> None:
    """The model hands attention q as a slice of the fused q/k projection: rows are strided, heads dense."""
    seq_lens, query_lens = BATCHES["decode"]
    query, layer, meta = make_case(seq_lens, query_lens, 16, 3, KVDtype.BF16, seed=6)
    padded = torch.cat([query, torch.full_like(query[:, :2], float("nan"))], dim=1)[:, : query.shape[1]]
    assert not padded.is_contiguous()
    reference = paged_attention(select_attention_impl("torch", CPU), query, layer, meta, SCALE)
    result = paged_attention(NativeCpuAttention(), padded, layer, meta, SCALE)
    assert torch.equal(result, paged_attention(NativeCpuAttention(), query, layer, meta, SCALE))
    assert (result.float() - reference.float()).abs().max().item() <= TOLERANCE[torch.bfloat16]


def test_never_reads_past_seq_len() -> None:
    """Stale slots of partly filled blocks (even NaNs) must not reach the output."""
    seq_lens, query_lens = BATCHES["decode"]
    query, layer, meta = make_case(seq_lens, query_lens, 16, 4, KVDtype.FP16, seed=3)
    reference, _ = run_both(query, layer, meta)
    poison_stale_slots(layer, meta)
    result = paged_attention(NativeCpuAttention(), query, layer, meta, SCALE)
    assert torch.isfinite(result).all()
    assert (result.float() - reference.float()).abs().max().item() <= TOLERANCE[torch.float16]


def test_missing_compiler_falls_back_to_torch(monkeypatch, tmp_path) -> None:
    """`auto` serves the torch path (and says why) when the C file cannot be built; `native` refuses."""
    load.cache_clear()
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    try:
        assert not cpu_native.available()
        assert type(select_attention_impl("auto", CPU)) is TorchAttention
        with pytest.raises(cpu_native.NativeBuildError, match="no C compiler"):
            NativeCpuAttention()
    finally:
        load.cache_clear()


def test_native_backend_is_refused_off_cpu() -> None:
    from pagedserve.engine.build import check_backends
    from pagedserve.engine.config import EngineConfig
    from pagedserve.engine.errors import ConfigError

    with pytest.raises(ConfigError, match="native runs on CPU") as info:
        check_backends(EngineConfig(attention_backend="native", device="cuda"))
    assert info.value.field == "attention_backend"


def _rows_alone_and_together(seq_len: int, drafts: int, queries_per_kv: int, kv_dtype: KVDtype, head_dim: int,
                             window: int | None, block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's decode row and its draft rows as the native step passes them (one entry per row, the same
    block table, contexts ending at consecutive positions) after another sequence's row: all in one call, and each
    row in a call of its own."""
    query, layer, meta = make_case((seq_len, 40), (1, 1), block_size, queries_per_kv, kv_dtype, head_dim, seed=9)
    rows = drafts + 2
    gen = torch.Generator().manual_seed(4)
    queries = torch.randn(rows, query.shape[1], head_dim, generator=gen).to(query.dtype)
    lens = [40] + [seq_len - drafts + i for i in range(drafts + 1)]
    tables = torch.stack([meta.block_tables[1]] + [meta.block_tables[0]] * (drafts + 1)).contiguous()
    together = torch.zeros_like(queries)
    batch = cpu_native.DecodeBatch(torch.arange(rows), torch.tensor(lens, dtype=torch.int32), tables, max(lens), window)
    cpu_native.decode_attention(queries, together, layer, batch, SCALE)
    alone = torch.zeros_like(queries)
    for r in range(rows):
        one = cpu_native.DecodeBatch(torch.zeros(1, dtype=torch.int64), torch.tensor([lens[r]], dtype=torch.int32),
                                     tables[r : r + 1].contiguous(), lens[r], window)
        out = torch.zeros_like(queries[r : r + 1])
        cpu_native.decode_attention(queries[r : r + 1].contiguous(), out, layer, one, SCALE)
        alone[r] = out[0]
    return together, alone


@pytest.mark.parametrize(("drafts", "queries_per_kv", "kv_dtype", "head_dim", "window"), [
    (4, 3, KVDtype.BF16, 64, None),
    (4, 3, KVDtype.FP8_E4M3, 64, 20),
    (7, 4, KVDtype.FP32, 128, None),
    (15, 8, KVDtype.FP16, 64, None),  # more rows than one task holds: the span is split
    (4, 3, KVDtype.INT8, 128, None),  # int8: each query rounded to int16 on its own (kv_dot.h)
    (3, 2, KVDtype.INT8, 80, 20),  # int8 at a runtime chunk count with a half 32-lane group
    (2, 1, KVDtype.BF16, 48, 9),  # a head_dim without a specialization: a runtime chunk count
    (2, 3, KVDtype.BF16, 40, 9),  # head_dim off the vector code: row by row
])
def test_draft_rows_read_the_cache_once_and_equal_rows_alone(drafts, queries_per_kv, kv_dtype, head_dim, window):
    """Rows over the same cached keys share one pass over K and V (kernels/cpu/decode_attention.c, spans), yet each
    row's output is bit-identical to the row computed alone: speculative verification must reproduce the logits of
    decoding without drafts token by token."""
    together, alone = _rows_alone_and_together(77, drafts, queries_per_kv, kv_dtype, head_dim, window)
    assert torch.isfinite(together).all()
    assert torch.equal(together, alone)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_draft_rows_over_several_key_chunks_equal_rows_alone(threads):
    """One stream's span cut into parts of rows (few KV heads per thread) over a context of several key chunks, on
    any thread count: still the bits of each row alone."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together, alone = _rows_alone_and_together(1300, 5, 3, KVDtype.BF16, 64, None)
    finally:
        torch.set_num_threads(previous)
    assert torch.isfinite(together).all()
    assert torch.equal(together, alone)
