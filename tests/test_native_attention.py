"""The native CPU decode and prefill attention (kernels/cpu/*_attention.c) against the torch implementation and float64 math.

The C file is compiled here, on first use, exactly as the engine compiles it; a machine without a C compiler
fails these tests rather than skipping them, because `auto` would silently serve the slower torch path there.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

import cpu_tiers

from attention_cases import (
    BATCHES,
    SCALE,
    TOLERANCE,
    assert_matches_torch,
    float64_reference,
    free_out_of_window,
    make_case,
    poison_stale_slots,
)
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.build import load
from pagedserve.kernels.cpu.prefill import PrefillBatch, amx_prefill
from pagedserve.kernels.cpu.structs import PrefillArgs
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


@pytest.mark.parametrize("tier", cpu_tiers.params(cpu_tiers.CORE))
@pytest.mark.parametrize("kv_dtype", [KVDtype.BF16, KVDtype.INT8])
def test_sdpa_takes_prefill_chunks_from_the_tiers_crossover(tier, kv_dtype, monkeypatch) -> None:
    """Where the C prefill kernel has AVX-512 it keeps chunks up to 2^17 queries x keys; without it (AVX2, portable)
    SDPA takes them from 2^12 (16-bit cache) or 2^13 (8-bit): a 96-token prompt goes to SDPA there, a 16-token one
    stays native everywhere, and the outputs are the torch path's either way."""
    from pagedserve.kernels import native_attention

    tier_library = cpu_native.load_library(tier)
    monkeypatch.setattr(native_attention, "load_library", lambda *_: tier_library)
    query, layer, meta = make_case((16, 96), (16, 96), 16, 3, kv_dtype, seed=2)
    plan = NativeCpuAttention().plan(meta, layer)
    wide = cpu_native.load_library(tier).pagedserve_isa_tier().startswith(b"avx512")
    assert plan.prefill.query_lens.tolist() == ([16, 96] if wide else [16])
    assert_matches_torch(NativeCpuAttention(), query, layer, meta)


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP32, KVDtype.BF16, KVDtype.FP8_E5M2])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_agrees_with_float64_math(kv_dtype: KVDtype, head_dim: int) -> None:
    """The native prefill kernel: chunks longer than its 16-position tiles, starting mid-block after cached context
    (chunked prefill), and a 2-token chunk; bf16 queries take the AVX512-BF16 dot-product path where the CPU has it."""
    seq_lens, query_lens = (300, 77, 129, 40), (300, 50, 2, 37)
    query, layer, meta = make_case(seq_lens, query_lens, 16, 3, kv_dtype, head_dim=head_dim, seed=8)
    exact = float64_reference(query, layer, meta)
    tolerance = 1e-5 if kv_dtype is KVDtype.FP32 else TOLERANCE[query.dtype]
    impl = NativeCpuAttention()
    assert impl.plan(meta, layer).prefill is not None  # the native kernel, not the SDPA fallback
    result = paged_attention(impl, query, layer, meta, SCALE)
    assert (result.double() - exact).abs().max().item() <= tolerance


def test_prefill_bf16_queries_over_fp8_keys() -> None:
    """A bf16 model with an FP8 cache: keys widen to bf16 exactly for the dot-product path."""
    seq_lens, query_lens = (200, 45), (200, 30)
    query, layer, meta = make_case(seq_lens, query_lens, 16, 3, KVDtype.FP8_E4M3, seed=9)
    query = query.to(torch.bfloat16)
    exact = float64_reference(query, layer, meta)
    result = paged_attention(NativeCpuAttention(), query, layer, meta, SCALE)
    assert (result.double() - exact).abs().max().item() <= TOLERANCE[torch.bfloat16]


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


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP32, KVDtype.BF16, KVDtype.FP16, KVDtype.FP8_E4M3])
def test_write_kv_equals_torch_store(kv_dtype: KVDtype) -> None:
    """The native KV write (compute-dtype caches) leaves the same bytes as the torch path; key rows come strided, as
    slices of the fused projection, and FP8 caches go through the torch path's quantization."""
    from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec

    dtype = QUERY_DTYPES_FOR_WRITE[kv_dtype]
    gen = torch.Generator().manual_seed(11)
    fused = torch.randn(37, 2 + 2 + 4, 64, generator=gen).to(dtype)  # [T, k heads | v heads | other, D]
    key, value = fused[:, 0:2], fused[:, 2:4]
    assert not key.is_contiguous()
    slots = torch.randperm(5 * 16, generator=gen)[:37].to(torch.int64)
    caches = []
    for impl in (select_attention_impl("torch", CPU), NativeCpuAttention()):
        cache = KVCache(KVCacheSpec(1, 2, 64, 16, kv_dtype), 5, CPU).layers[0]
        impl.write_kv(key, value, cache, slots)
        caches.append(cache)
    assert torch.equal(caches[0].k.view(torch.uint8), caches[1].k.view(torch.uint8))
    assert torch.equal(caches[0].v.view(torch.uint8), caches[1].v.view(torch.uint8))


def test_write_kv_refuses_a_slot_outside_the_cache() -> None:
    from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec

    cache = KVCache(KVCacheSpec(1, 2, 64, 16, KVDtype.BF16), 2, CPU).layers[0]
    rows = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(IndexError, match="outside the cache's 32 slots"):
        NativeCpuAttention().write_kv(rows, rows, cache, torch.tensor([3, 32]))
    assert not cache.k.any()  # checked before anything is written


QUERY_DTYPES_FOR_WRITE = {KVDtype.FP32: torch.float32, KVDtype.BF16: torch.bfloat16, KVDtype.FP16: torch.float16,
                          KVDtype.FP8_E4M3: torch.bfloat16}


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


@pytest.mark.parametrize("tier", cpu_tiers.params(cpu_tiers.CORE))
@pytest.mark.parametrize("kv_dtype", [KVDtype.INT8, KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_native_8_bit_gather_equals_torch(kv_dtype: KVDtype, out_dtype: torch.dtype, tier: str, monkeypatch) -> None:
    """The long prefill's native gather of an 8-bit cache (int8 row scales, FP8 head scales, FP8 widened through
    fp16 bits) returns kv_quant.gather_kv's values bit for bit at each ISA tier, tiles in any order and repeated,
    head dim 80 (five 16-lane groups); a tile outside the cache is refused."""
    from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec
    from pagedserve.kernels.kv_quant import gather_kv, head_tiles, store_kv

    tier_library = cpu_native.load_library(tier)
    monkeypatch.setattr(cpu_native, "load_library", lambda *_: tier_library)

    gen = torch.Generator().manual_seed(5)
    cache = KVCache(KVCacheSpec(1, 3, 80, 8, kv_dtype), 7, CPU).layers[0]
    cache.k_scale.copy_(torch.tensor([0.02, 0.5, 3.0]))
    cache.v_scale.copy_(torch.tensor([1.0, 0.07, 0.3]))
    rows = torch.randn(56, 3, 80, generator=gen) * torch.logspace(-3, 2, 56)[:, None, None]
    store_kv(rows, -2 * rows, cache, torch.randperm(56, generator=gen))
    tiles = head_tiles(torch.tensor([4, 0, 6, 4, 2]), 3, 7)
    reference = gather_kv(cache, tiles, out_dtype)
    native = cpu_native.gather_kv_8bit(cache, tiles, out_dtype)
    for ref, got in zip(reference, native):
        assert got.shape == ref.shape and got.dtype == out_dtype and torch.equal(got, ref)
    with pytest.raises(IndexError, match="outside the cache's 21 tiles"):
        cpu_native.gather_kv_8bit(cache, torch.tensor([0, 21, 3], dtype=torch.int64), out_dtype)


@pytest.mark.parametrize("tier", cpu_tiers.params(cpu_tiers.CORE))
@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("kv_dtype", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_native_fp8_write_rounds_every_tie_like_torch(kv_dtype: KVDtype, head_dim: int, tier: str,
                                                      monkeypatch) -> None:
    """The native FP8 write (16 lanes at a time, head dim 72's last 8 lanes one by one) against the torch store byte
    for byte at each ISA tier: every finite value of the format, the midpoints between neighbours (ties to even),
    subnormals, values past the range (saturated), zeros and NaN; fp32 rows with scale 1 (exact ties) and bf16 rows
    over a head scale that is not a power of two."""
    from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec

    tier_library = cpu_native.load_library(tier)
    monkeypatch.setattr(cpu_native, "load_library", lambda *_: tier_library)
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_dtype.torch_dtype).float()
    finite = values[values.isfinite()].unique()  # sorted
    mids = (finite[1:] + finite[:-1]) / 2
    extra = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 5e4, -5e4, 1e6, -1e6, float("nan"), float("inf"), -float("inf")])
    flat = torch.cat([finite, mids, mids * 1.0000001, extra])
    rows = torch.nn.functional.pad(flat, (0, -flat.numel() % (2 * head_dim))).view(-1, 2, head_dim)
    for dtype, head_scale in ((torch.float32, 1.0), (torch.bfloat16, 0.37)):
        x = rows.to(dtype) * (head_scale if dtype == torch.bfloat16 else 1.0)
        slots = torch.arange(x.shape[0], dtype=torch.int64)
        caches = []
        for impl in (select_attention_impl("torch", CPU), NativeCpuAttention()):
            cache = KVCache(KVCacheSpec(1, 2, head_dim, 16, kv_dtype), -(-x.shape[0] // 16), CPU).layers[0]
            cache.k_scale.fill_(head_scale), cache.v_scale.fill_(head_scale / 3)
            impl.write_kv(x, -x, cache, slots)
            caches.append(cache)
        assert torch.equal(caches[0].k.view(torch.uint8), caches[1].k.view(torch.uint8))
        assert torch.equal(caches[0].v.view(torch.uint8), caches[1].v.view(torch.uint8))


def _prefill_with(lib, query, layer, meta, window: int | None, threads: int = 1) -> torch.Tensor:
    """Every chunk of `meta` through `lib`'s prefill kernel (one build of one tier)."""
    batch = PrefillBatch.of(meta, meta.query_starts(), window, tuple(range(meta.num_seqs)))
    out = torch.empty(query.shape, dtype=query.dtype)
    args = PrefillArgs(**cpu_native.attention_fields(query, out, layer, batch, SCALE),
                       query_lens=batch.query_lens.data_ptr())
    assert lib.pagedserve_prefill_attention(ctypes.addressof(args), meta.num_seqs, threads) == 0
    return out


# (KV heads' query heads, block size, window, head dim): 3 and 4 heads make 48 and 64 rows a task (3 and 4 blocks
# of 16 lanes), block size 8 gives tiles of 8 keys, head dim 80 is not a multiple of 32 (AMX tiles take 32).
PREFILL_SHAPES = [(3, 16, None, 64), (4, 8, 40, 128), (1, 32, None, 80)]


@pytest.mark.parametrize("tier", cpu_tiers.params(("native", "avx512_bf16", "avx2")))
@pytest.mark.parametrize("kv_dtype", [KVDtype.BF16, KVDtype.INT8, KVDtype.FP8_E4M3])
@pytest.mark.parametrize(("queries_per_kv", "block_size", "window", "head_dim"), PREFILL_SHAPES)
def test_bf16_prefill_at_each_tier_agrees_with_float64_math(tier, kv_dtype, queries_per_kv, block_size, window,
                                                           head_dim) -> None:
    """bf16 queries over 16- and 8-bit caches: AMX scores where granted (native), AVX512-BF16 dot products
    (forced avx512_bf16), fp32 FMAs (avx2); chunks after cached context starting mid-block, NaN in stale slots
    (poison_stale_slots writes no FP8)."""
    seq_lens, query_lens = (300, 77, 129, 41), (300, 50, 2, 37)
    query, layer, meta = make_case(seq_lens, query_lens, block_size, queries_per_kv, kv_dtype, head_dim=head_dim,
                                   seed=11)
    query = query.to(torch.bfloat16)
    exact = float64_reference(query, layer, meta, window)
    if not kv_dtype.is_fp8:
        poison_stale_slots(layer, meta)
    lib = cpu_native.load_library(None if tier == "native" else tier)
    result = _prefill_with(lib, query, layer, meta, window)
    assert (result.double() - exact).abs().max().item() <= TOLERANCE[torch.bfloat16]
    assert torch.equal(_prefill_with(lib, query, layer, meta, window, threads=3), result)  # tasks are independent


@pytest.mark.parametrize("tier", cpu_tiers.params(("native", "avx512_bf16")))
@pytest.mark.parametrize(("kv_dtype", "block_size", "window"),
                         [(KVDtype.BF16, 16, 37), (KVDtype.BF16, 8, 200), (KVDtype.INT8, 16, 130)])
def test_bf16_prefill_skips_freed_blocks_over_many_key_steps(tier, kv_dtype, block_size, window) -> None:
    """Chunks whose rows see several of the AMX kernel's 128-key steps, with a window whose edge falls inside a step
    and the blocks behind it freed (their table entries point at NaN): V^T built once per chunk skips them, the
    steps where every row sees every key drop the mask, and the output agrees with float64 math (head dim 64:
    AMX tiles where granted; the forced tier runs vdpbf16ps)."""
    seq_lens, query_lens = (600, 333, 290), (600, 140, 3)
    query, layer, meta = make_case(seq_lens, query_lens, block_size, 3, kv_dtype, seed=14)
    query = query.to(torch.bfloat16)
    exact = float64_reference(query, layer, meta, window)
    freed = free_out_of_window(layer, meta, window)
    assert not torch.equal(freed.block_tables, meta.block_tables)  # some blocks really were left behind
    lib = cpu_native.load_library(None if tier == "native" else tier)
    result = _prefill_with(lib, query, layer, freed, window, threads=2)
    assert (result.double() - exact).abs().max().item() <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("tier", cpu_tiers.params(("native", "avx512_bf16")))
@pytest.mark.parametrize("kv_dtype", [KVDtype.BF16, KVDtype.INT8, KVDtype.FP8_E4M3])
@pytest.mark.parametrize("window", [None, 250])
def test_long_bf16_chunks_stay_native_where_the_kernel_runs_bf16_products(tier, kv_dtype, window, monkeypatch) -> None:
    """Chunks long enough for SDPA (kernels/native_attention.py) that follow cached context, or that a window cuts,
    run the bf16 kernel instead for bf16 queries where it has AMX tiles or vdpbf16ps (the host's build, or the forced
    avx512_bf16 tier): over a bf16 cache reading blocks in place, over an 8-bit one reading them dequantized once into
    contiguous bf16 (with a window, the blocks before it neither gathered nor read), and so do chunks from position 0
    of any length; other query dtypes, and builds with neither, take SDPA for all of them. The tier's own library
    plans and computes (the prefill kernel's loader is the one the plan asks)."""
    from pagedserve.kernels.cpu import prefill as cpu_prefill

    lib = cpu_native.load_library(None if tier == "native" else tier)
    monkeypatch.setattr(cpu_prefill, "load_library", lambda: lib)
    seq_lens, query_lens = (700, 45, 1500, 600), (400, 30, 1500, 600)
    query, layer, meta = make_case(seq_lens, query_lens, 16, 3, kv_dtype, seed=12)
    impl = NativeCpuAttention()
    plan = impl.plan(meta, layer, window)
    amx = bool(lib.pagedserve_prefill_amx(64))
    bf16_products = amx or lib.pagedserve_isa_tier() == b"avx512_bf16"
    assert amx_prefill(layer) == amx and cpu_prefill.bf16_long_prefill(layer) == bf16_products
    kernel = (0, 2, 3)
    if bf16_products:
        starts = {0: 0, 2: 430, 3: 1930}
        (long,) = plan.prefill_long  # one gathered buffer: 2,800 keys at most
        assert long.batch.rows.tolist() == [starts[i] for i in kernel]
        assert (long.tiles is None) == (kv_dtype is KVDtype.BF16)
        assert len(plan.prefill_sdpa) == 3 - len(kernel) and len(plan.prefill_long_sdpa) == len(kernel)
    else:
        assert plan.prefill_long == () and len(plan.prefill_sdpa) == 3
    assert plan.prefill.rows.tolist() == [400]  # the short chunk stays native for every query dtype
    for dtype in (torch.bfloat16, torch.float16):  # fp16 queries take SDPA for every long chunk
        result = impl.attention(query.to(dtype), layer, meta, plan, SCALE)
        exact = float64_reference(query.to(dtype), layer, meta, window)
        assert (result.double() - exact).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("kv_dtype", [KVDtype.INT8, KVDtype.FP8_E5M2])
@pytest.mark.parametrize(("window", "block_size", "gather_tokens"),
                         [(None, 16, 16384), (90, 8, 16384), (None, 16, 320)])
def test_long_prefill_over_gathered_8_bit_blocks(kv_dtype, window, block_size, gather_tokens, monkeypatch) -> None:
    """An 8-bit cache's chunks through the bf16 kernel over their blocks dequantized into bf16 buffers, on any host
    (the kernel's tier is whatever this one builds): the gathered blocks are exactly the chunks' visible ones, the
    remapped tables index them, a cap on a buffer's keys splits the chunks into parts (one chunk past the cap alone),
    and the output agrees with float64 math, on one thread and on three."""
    from pagedserve.kernels.cpu import prefill as cpu_prefill

    monkeypatch.setattr(cpu_prefill, "GATHER_TOKENS", gather_tokens)
    seq_lens, query_lens = (300, 77, 129), (300, 50, 2)
    query, layer, meta = make_case(seq_lens, query_lens, block_size, 3, kv_dtype, seed=13)
    query = query.to(torch.bfloat16)
    batch = PrefillBatch.of(meta, meta.query_starts(), window, (0, 1, 2))
    parts = cpu_prefill.LongPrefill.of(layer, batch)
    firsts = [max(0, s - q - (window or s) + 1) // block_size for s, q in zip(seq_lens, query_lens)]
    blocks = [-(-s // block_size) - f for s, f in zip(seq_lens, firsts)]
    chunks = [[0, 1, 2]] if gather_tokens > 1000 else [[0], [1, 2]]  # 304 keys, then 80 + 144
    assert [p.batch.rows.tolist() for p in parts] == [[[0, 300, 350][i] for i in c] for c in chunks]
    for part, c in zip(parts, chunks):
        assert part.tiles is not None and part.tiles.shape == (layer.k.shape[2] * sum(blocks[i] for i in c),)
        for row, i in enumerate(c):
            assert (part.batch.block_tables[row, : firsts[i]] == -1).all()
    outs, previous = [], torch.get_num_threads()
    try:
        for threads in (1, 3):
            out = torch.full_like(query, float("nan"))
            torch.set_num_threads(threads)
            for part in parts:
                cpu_prefill.long_prefill_native(query, out, layer, part, SCALE)
            outs.append(out)
    finally:
        torch.set_num_threads(previous)
    exact = float64_reference(query, layer, meta, window)
    assert (outs[0].double() - exact).abs().max().item() <= TOLERANCE[torch.bfloat16]
    assert torch.equal(outs[0], outs[1])
