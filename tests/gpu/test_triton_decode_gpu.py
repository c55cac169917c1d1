"""The split-context decode kernel compiled on a GPU at serving sizes: 32k contexts, every cache dtype, windows.

Marked `gpu` and skipped without CUDA (tests/test_triton_decode_attention.py runs the same kernel under the
interpreter on small shapes). Throughput is measured by tests/gpu/bench_check.py, not here.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

triton = pytest.importorskip("triton")

import tiny_models  # noqa: E402,F401  (puts tests/ on sys.path for attention_cases)
from attention_cases import free_out_of_window  # noqa: E402
from pagedserve.kernels.backends import ATTENTION_IMPLS, select_attention_impl  # noqa: E402
from pagedserve.kernels.kv_cache import KVDtype  # noqa: E402
from pagedserve.kernels.paged_attention import paged_attention  # noqa: E402
from pagedserve.kernels.triton_decode_attention import MAX_PARTITIONS, triton_decode_attention  # noqa: E402
from test_triton_gpu import CUDA, TOLERANCE, build, fp8_dtypes  # noqa: E402

LONG = (32768, 20000, 1, 777, 16384, 4095)


@pytest.fixture(autouse=True)
def compiled_kernels() -> None:
    from pagedserve.kernels.triton_backend import kernels_interpreted

    if kernels_interpreted():
        pytest.skip("TRITON_INTERPRET=1 in this process: run `pytest -m gpu tests/gpu` on its own")


def reference(query, layer, meta, window=None) -> torch.Tensor:
    return paged_attention(select_attention_impl("torch", CUDA), query, layer, meta, query.shape[-1] ** -0.5,
                           window=window)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.cuda.synchronize()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOLERANCE[want.dtype], f"max abs err {err}"


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP16, KVDtype.BF16, KVDtype.FP8_E4M3, KVDtype.FP8_E5M2, KVDtype.INT8])
def test_long_contexts_every_partition_count(kv_dtype: KVDtype) -> None:
    """32k, 20k and 16k contexts beside 1- and 777-token ones: the engine's rule, a single pass, the most partitions."""
    if kv_dtype.is_fp8 and kv_dtype not in fp8_dtypes():
        pytest.skip("fp8_e4m3 needs compute capability 8.9+")
    qdtype = torch.bfloat16 if kv_dtype == KVDtype.BF16 else torch.float16
    query, layer, meta = build(LONG, (1,) * len(LONG), 16, 8, 4, 128, kv_dtype, qdtype)
    want = reference(query, layer, meta)
    assert_close(paged_attention(ATTENTION_IMPLS.get("triton")(), query, layer, meta, 128**-0.5), want)
    for parts in (1, MAX_PARTITIONS):
        assert_close(triton_decode_attention(query, layer, meta, 128**-0.5, num_partitions=parts), want)


@pytest.mark.parametrize("head_dim,queries_per_kv,block_size", [(80, 5, 16), (256, 1, 128), (64, 8, 32), (128, 1, 64)])
@pytest.mark.parametrize("kv_dtype", [KVDtype.FP16, KVDtype.INT8])
def test_odd_head_dims_gqa_ratios_and_block_sizes(head_dim, queries_per_kv, block_size, kv_dtype) -> None:
    seq_lens = (9000, 1, 130, 5000)
    query, layer, meta = build(seq_lens, (1,) * 4, block_size, 3, queries_per_kv, head_dim, kv_dtype, torch.float16)
    got = paged_attention(ATTENTION_IMPLS.get("triton")(), query, layer, meta, head_dim**-0.5)
    assert_close(got, reference(query, layer, meta))


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP16, KVDtype.INT8])
@pytest.mark.parametrize("window", [4096, 100])
def test_sliding_window_over_freed_blocks(kv_dtype: KVDtype, window: int) -> None:
    """Blocks behind the window point at a NaN block: partitions behind it must not read them."""
    # Two spare blocks: the tables' padding of the shorter sequences points at block 0, the NaN block is block 1.
    query, layer, meta = build(LONG, (1,) * len(LONG), 16, 8, 4, 128, kv_dtype, torch.float16, extra_blocks=2)
    want = reference(query, layer, meta, window)
    freed = free_out_of_window(layer, meta, window)
    for parts in (None, 8):
        got = triton_decode_attention(query, layer, freed, 128**-0.5, window, num_partitions=parts)
        assert torch.isfinite(got).all()
        assert_close(got, want)


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2, KVDtype.INT8])
@pytest.mark.parametrize(("word_tiles", "keys_major"), [(True, False), (True, True), (False, True)])
def test_word_tiles_and_keys_major_at_long_contexts(kv_dtype: KVDtype, word_tiles: bool, keys_major: bool) -> None:
    """The launch options the bench sweeps (docs/gpu.md), at the sweep's launches: 32k contexts, a single pass, the
    most partitions, 128 tokens and 4 warps in one and three stages, 64 tokens and 8 warps."""
    if kv_dtype.is_fp8 and (word_tiles or kv_dtype not in fp8_dtypes()) and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 caches and FP8 word tiles need compute capability 8.9+")
    query, layer, meta = build(LONG, (1,) * len(LONG), 16, 8, 4, 128, kv_dtype, torch.float16)
    want = reference(query, layer, meta)
    for parts, tile, warps, stages in ((1, 128, 4, 1), (MAX_PARTITIONS, 128, 4, None), (None, 64, 8, 1)):
        got = triton_decode_attention(query, layer, meta, 128**-0.5, num_partitions=parts, tile_n=tile,
                                      num_warps=warps, num_stages=stages, word_tiles=word_tiles,
                                      keys_major=keys_major)
        assert_close(got, want)
