"""The decode kernel's word tiles (kernels/triton_decode_words.py: 8-bit K/V rows loaded as 32-bit words and widened
to fp16 before tl.dot) and keys-major tile step (kernels/triton_decode_keys_major.py: S^T = K Q^T, the query group
padded to 8), against the torch implementation and against the kernel's default path on identical caches.

Without CUDA the kernel runs under Triton's interpreter, which widens with Triton ops; with CUDA (tests/gpu collects
these cases) the words are widened by the PTX the launch compiles, so there every byte value of every format is
checked on its own as well (test_every_byte_widens_to_its_fp16_value).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from attention_cases import (  # noqa: E402
    DEVICE, SCALE, TOLERANCE, free_out_of_window, make_case, poison_stale_slots,
)
from pagedserve.kernels.kv_cache import KVDtype  # noqa: E402
from pagedserve.kernels.triton_attention import INTERPRETED  # noqa: E402
from pagedserve.kernels.triton_decode_attention import triton_decode_attention  # noqa: E402
from pagedserve.kernels.triton_decode_words import WORD_FORMATS, widen_words  # noqa: E402
from test_triton_decode_attention import DECODE, SEQ_LENS, assert_close, torch_reference  # noqa: E402

EIGHT_BIT = (KVDtype.FP8_E4M3, KVDtype.FP8_E5M2, KVDtype.INT8)


def assert_same_as_byte_path(got: torch.Tensor, bytes_path: torch.Tensor) -> None:
    """Both paths give tl.dot the same operands (compiled: the same exact conversions), so their outputs are at most
    one output rounding step apart (a GPU's MMA may sum in another order; the step grows with |out| past 2)."""
    assert torch.isfinite(got).all()
    err = (got.float() - bytes_path.float()).abs() / bytes_path.float().abs().clamp(min=1)
    assert err.max().item() <= TOLERANCE[got.dtype], f"word tiles differ from the byte path by {err.max().item()}"


@triton.jit
def _widen_kernel(words_ptr, out_ptr, N: tl.constexpr, FORMAT: tl.constexpr, PTX: tl.constexpr):
    rows = tl.arange(0, N)[:, None] * 2 + tl.arange(0, 2)[None, :]
    out = widen_words(tl.load(words_ptr + rows), FORMAT, PTX)  # [N, 8]
    tl.store(out_ptr + tl.arange(0, N)[:, None] * 8 + tl.arange(0, 8)[None, :], out)


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
def test_every_byte_widens_to_its_fp16_value(kv_dtype: KVDtype) -> None:
    """All 256 byte values at each of a word's four positions: the fp16 torch converts the value to (NaN for NaN;
    Triton's interpreter emulates e4m3 with NaN as +-480, so there its two NaN bytes are left out)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    shuffled = torch.stack([values.roll(3 * e) for e in range(4)], dim=1)  # each position sees every value
    raw = shuffled.reshape(-1).view(torch.int32).reshape(128, 2)  # 256 words, rows of two
    out = torch.empty(128, 8, dtype=torch.float16, device=DEVICE)
    _widen_kernel[(1,)](raw.to(DEVICE), out, N=128, FORMAT=WORD_FORMATS[kv_dtype], PTX=not INTERPRETED)
    want = shuffled.reshape(-1).view(kv_dtype.torch_dtype).to(torch.float16).reshape(128, 8)
    got, nan = out.cpu(), want.isnan()
    if not (INTERPRETED and kv_dtype is KVDtype.FP8_E4M3):
        assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize("keys_major", [False, True])
@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
@pytest.mark.parametrize(("queries_per_kv", "block_size", "num_partitions", "tile_n"), [
    (1, 16, 4, 16), (4, 32, 4, 16), (8, 16, 1, 16), (4, 16, 2, None), (5, 16, 1, 32),
])
def test_word_tiles_match_torch_and_the_byte_path(
    kv_dtype: KVDtype, queries_per_kv: int, block_size: int, num_partitions: int, tile_n: int | None,
    keys_major: bool,
) -> None:
    """GQA groups of 1 to 8 (5: a padded group), 16- and 32-token blocks, split and single pass, small and default
    tiles (a tile spans several blocks or part of one), with either tile step."""
    query, layer, meta = make_case(SEQ_LENS, DECODE, block_size, queries_per_kv, kv_dtype, seed=queries_per_kv)
    launch = dict(num_partitions=num_partitions, tile_n=tile_n)
    got = triton_decode_attention(query, layer, meta, SCALE, word_tiles=True, keys_major=keys_major, **launch)
    assert_close(got, torch_reference(query, layer, meta))
    assert_same_as_byte_path(got, triton_decode_attention(query, layer, meta, SCALE, **launch))


@pytest.mark.parametrize(("kv_dtype", "queries_per_kv"), [
    (KVDtype.FP16, 1), (KVDtype.FP16, 16), (KVDtype.BF16, 4), (KVDtype.FP8_E4M3, 8), (KVDtype.INT8, 16),
])
def test_keys_major_over_bytes_and_16_bit_caches(kv_dtype: KVDtype, queries_per_kv: int) -> None:
    """The keys-major step takes any cache as the default loads it (16 query heads: a group of 16, not 8)."""
    query, layer, meta = make_case(SEQ_LENS, DECODE, 16, queries_per_kv, kv_dtype, seed=20 + queries_per_kv)
    launch = dict(num_partitions=4, tile_n=16)
    got = triton_decode_attention(query, layer, meta, SCALE, keys_major=True, **launch)
    assert_close(got, torch_reference(query, layer, meta))
    assert_same_as_byte_path(got, triton_decode_attention(query, layer, meta, SCALE, **launch))


@pytest.mark.parametrize(("head_dim", "kv_dtype"), [
    (80, KVDtype.INT8), (80, KVDtype.FP8_E4M3), (20, KVDtype.FP8_E5M2), (128, KVDtype.INT8),
])
def test_head_dims_padded_to_a_power_of_two_and_the_prefetch(head_dim: int, kv_dtype: KVDtype) -> None:
    """Head dims below their power of two mask the words past the row (80 of 128, 20 of 32); the next tile's
    prefetch takes word tiles too."""
    query, layer, meta = make_case(SEQ_LENS, DECODE, 16, 4, kv_dtype, head_dim=head_dim, seed=head_dim)
    want = torch_reference(query, layer, meta)
    for prefetch in (False, True):
        got = triton_decode_attention(query, layer, meta, SCALE, num_partitions=2, tile_n=16, prefetch=prefetch,
                                      word_tiles=True, keys_major=prefetch)
        assert_close(got, want)


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
@pytest.mark.parametrize(("window", "keys_major"), [(5, False), (70, False), (5, True), (70, True)])
def test_sliding_window_and_stale_slots_are_never_read(kv_dtype: KVDtype, window: int, keys_major: bool) -> None:
    """NaN in every slot past each sequence's end and in the blocks behind the window (freed): masked words read 0."""
    query, layer, meta = make_case(SEQ_LENS, DECODE, 16, 4, kv_dtype, seed=7)
    want = torch_reference(query, layer, meta, window)
    freed = free_out_of_window(layer, meta, window)
    poison_stale_slots(layer, freed)
    got = triton_decode_attention(query, layer, freed, SCALE, window, num_partitions=4, tile_n=16, word_tiles=True,
                                  keys_major=keys_major)
    assert torch.isfinite(got).all()
    assert_close(got, want)


@pytest.mark.parametrize("keys_major", [False, True])
@pytest.mark.parametrize(("kv_dtype", "query_dtype"), [
    (KVDtype.INT8, torch.bfloat16), (KVDtype.FP8_E4M3, torch.bfloat16), (KVDtype.INT8, torch.float32),
])
def test_bf16_and_fp32_queries(kv_dtype: KVDtype, query_dtype: torch.dtype, keys_major: bool) -> None:
    """The widened fp16 values become bf16 (fp32) operands exactly: every FP8 and int8 value is a bf16 value.
    Outputs of int8 rows reach |4| (a 1-token context returns its V row), where one bf16 rounding step is 2^-5: the
    bound scales with the output. The byte path is compared compiled only: the interpreter turns int8 into bf16 by
    reinterpreting the bits (1 -> 0, -1 -> NaN)."""
    query, layer, meta = make_case(SEQ_LENS, DECODE, 16, 4, kv_dtype, seed=11)
    query = query.to(query_dtype)
    got = triton_decode_attention(query, layer, meta, SCALE, num_partitions=2, tile_n=16, word_tiles=True,
                                  keys_major=keys_major)
    want = torch_reference(query, layer, meta).float()
    assert ((got.float() - want).abs() <= TOLERANCE[query_dtype] * want.abs().clamp(min=1)).all()
    if not INTERPRETED:
        assert_same_as_byte_path(got, triton_decode_attention(query, layer, meta, SCALE, num_partitions=2,
                                                              tile_n=16))


def test_caches_word_tiles_do_not_take_are_refused() -> None:
    """16-bit caches have nothing to widen; a head dim that is no multiple of 4 leaves rows off word boundaries."""
    query, layer, meta = make_case(SEQ_LENS, DECODE, 16, 4, KVDtype.FP16, seed=1)
    with pytest.raises(ValueError, match="8-bit caches"):
        triton_decode_attention(query, layer, meta, SCALE, word_tiles=True)
    query, layer, meta = make_case(SEQ_LENS, DECODE, 16, 4, KVDtype.INT8, head_dim=18, seed=1)
    with pytest.raises(ValueError, match="4-byte aligned"):
        triton_decode_attention(query, layer, meta, SCALE, word_tiles=True)
