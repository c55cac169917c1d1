"""The native CPU prefill kernel (kernels/cpu/prefill_attention.c) against the torch path and float64 math: which
chunks it keeps and which go to SDPA at each ISA tier, its bf16 paths (AMX, AVX512-BF16, fp32 FMAs) over 16- and
8-bit caches, and the 8-bit blocks gathered for long chunks, since a wrong plan or gather would serve wrong tokens
silently."""

from __future__ import annotations

import ctypes

import pytest
import torch

import cpu_tiers

from attention_cases import (
    SCALE,
    TOLERANCE,
    assert_matches_torch,
    float64_reference,
    free_out_of_window,
    make_case,
    poison_stale_slots,
)
from pagedserve.kernels.cpu import isa, native as cpu_native
from pagedserve.kernels.cpu.prefill import PrefillBatch, amx_prefill
from pagedserve.kernels.cpu.structs import PrefillArgs
from pagedserve.kernels.kv_cache import KVDtype
from pagedserve.kernels.native_attention import NativeCpuAttention
from pagedserve.kernels.paged_attention import paged_attention

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="cases are built on the GPU when one is present")


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
# Chunks after cached context starting mid-block, one of 2 new tokens, one of 37 (a partial task).
PREFILL_LENS = ((300, 77, 129, 41), (300, 50, 2, 37))


@pytest.mark.parametrize("tier", cpu_tiers.params(("native", "avx512_bf16", "avx2")))
@pytest.mark.parametrize("kv_dtype", [KVDtype.BF16, KVDtype.INT8, KVDtype.FP8_E4M3])
@pytest.mark.parametrize(("queries_per_kv", "block_size", "window", "head_dim"), PREFILL_SHAPES)
def test_bf16_prefill_at_each_tier_agrees_with_float64_math(tier, kv_dtype, queries_per_kv, block_size, window,
                                                           head_dim) -> None:
    """bf16 queries over 16- and 8-bit caches: AMX scores where granted (native), AVX512-BF16 dot products
    (forced avx512_bf16), fp32 FMAs (avx2); chunks after cached context starting mid-block, NaN in stale slots
    (poison_stale_slots writes no FP8)."""
    seq_lens, query_lens = PREFILL_LENS
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


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP32, KVDtype.BF16, KVDtype.INT8, KVDtype.FP8_E4M3])
def test_the_avx2_build_gives_the_avx512_builds_bits(kv_dtype) -> None:
    """The AVX2 build scores and sums values in ymm passes (4 query rows, 32 dimensions at a time, a 16-dimension
    tail at head dim 80), the AVX-512 build in 16-lane ones over 8 rows and whole rows: the same products and sums in
    the same order, so the same bits, for fp32 and bf16 queries, tasks of 48, 64 and 1-16 rows (partial passes)."""
    have = isa.available_tiers()
    if "avx2" not in have or "avx512" not in have:
        pytest.skip("this CPU lacks the avx2 or the avx512 tier")
    narrow, wide = cpu_native.load_library("avx2"), cpu_native.load_library("avx512")
    for queries_per_kv, block_size, window, head_dim in PREFILL_SHAPES:
        query, layer, meta = make_case(*PREFILL_LENS, block_size, queries_per_kv, kv_dtype, head_dim=head_dim, seed=13)
        for q in (query, query.to(torch.bfloat16)):
            assert torch.equal(_prefill_with(narrow, q, layer, meta, window), _prefill_with(wide, q, layer, meta, window))


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
