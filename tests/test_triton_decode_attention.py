"""The split-context Triton decode kernel against the torch implementation on identical caches.

Without CUDA it runs under Triton's interpreter (tests/conftest.py), with CUDA compiled (tests/gpu collects the
kernel cases). Contexts are cut into several partitions, the last one partial, beside sequences shorter than one
partition (whose later partitions exit at once); tiles of 16 tokens make every partition several tiles long.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from attention_cases import (  # noqa: E402
    DEVICE, SCALE, TOLERANCE, float64_reference, free_out_of_window, make_case, poison_stale_slots,
)
from pagedserve.kernels.backends import select_attention_impl  # noqa: E402
from pagedserve.kernels.kv_cache import KVDtype  # noqa: E402
from pagedserve.kernels.triton_decode_attention import (  # noqa: E402
    MAX_PARTITIONS, decode_partitions, triton_decode_attention,
)

# 200 tokens in 4 partitions of 64 (the last holds 8); 17 and 1 leave partitions past their end; 129 crosses a block.
SEQ_LENS = (200, 17, 129, 1, 40)
DECODE = (1,) * len(SEQ_LENS)


def torch_reference(query, layer, meta, window=None) -> torch.Tensor:
    impl = select_attention_impl("torch", torch.device("cpu"))
    return impl.attention(query, layer, meta, impl.plan(meta, layer, window), SCALE)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOLERANCE[want.dtype], f"max abs err {err}"


@pytest.mark.parametrize(("kv_dtype", "queries_per_kv"), [
    (KVDtype.FP16, 1), (KVDtype.FP16, 4), (KVDtype.FP16, 8), (KVDtype.BF16, 4), (KVDtype.FP8_E4M3, 8),
    (KVDtype.FP8_E5M2, 1), (KVDtype.INT8, 4), (KVDtype.INT8, 8),
])
def test_split_partitions_match_torch(kv_dtype: KVDtype, queries_per_kv: int) -> None:
    block_size = 32 if queries_per_kv == 4 else 16
    query, layer, meta = make_case(SEQ_LENS, DECODE, block_size, queries_per_kv, kv_dtype, seed=queries_per_kv)
    got = triton_decode_attention(query, layer, meta, SCALE, num_partitions=4, tile_n=16)
    assert_close(got, torch_reference(query, layer, meta))


@pytest.mark.parametrize(("head_dim", "kv_dtype"), [(80, KVDtype.FP16), (128, KVDtype.FP8_E4M3), (128, KVDtype.INT8)])
@pytest.mark.parametrize("num_partitions", [1, 2])
def test_head_dims_single_pass_and_default_tiles(head_dim: int, kv_dtype: KVDtype, num_partitions: int) -> None:
    """Head dims padded to a power of two; one partition writes the output without the reduce; default tiles, with
    and without the next tile's prefetch."""
    query, layer, meta = make_case(SEQ_LENS, DECODE, 16, 4, kv_dtype, head_dim=head_dim, seed=head_dim)
    got = triton_decode_attention(query, layer, meta, SCALE, num_partitions=num_partitions,
                                  prefetch=num_partitions == 2)
    assert_close(got, torch_reference(query, layer, meta))


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP16, KVDtype.INT8])
@pytest.mark.parametrize("window", [5, 70])
def test_sliding_window_never_reads_freed_blocks(kv_dtype: KVDtype, window: int) -> None:
    """Blocks wholly behind the window point at a NaN block (freed); partitions behind it exit, the reduce skips
    them, and tiles that start before the first visible key mask those rows out of their loads."""
    query, layer, meta = make_case(SEQ_LENS, DECODE, 16, 4, kv_dtype, seed=7)
    want = torch_reference(query, layer, meta, window)
    freed = free_out_of_window(layer, meta, window)
    got = triton_decode_attention(query, layer, freed, SCALE, window, num_partitions=4, tile_n=16)
    assert torch.isfinite(got).all()
    assert_close(got, want)


def test_never_reads_past_seq_len_and_agrees_with_float64() -> None:
    query, layer, meta = make_case(SEQ_LENS, DECODE, 16, 4, KVDtype.FP32, seed=3)
    exact = float64_reference(query, layer, meta)
    poison_stale_slots(layer, meta)
    got = triton_decode_attention(query, layer, meta, SCALE, num_partitions=8, tile_n=16)
    assert (got.double().cpu() - exact).abs().max().item() < 1e-5


def test_replays_with_new_lengths_and_a_wider_table_without_host_data() -> None:
    """What a CUDA graph replay does: same launch (partition count from the table's width), the device lengths
    changed in place (host copies stale) and the table padded wider; the output follows the device lengths."""
    query, layer, meta = make_case(SEQ_LENS, DECODE, 16, 2, KVDtype.FP16, seed=5)
    shorter = (150, 3, 129, 1, 33)
    wide = torch.zeros(meta.block_tables.shape[0], 64, dtype=torch.int32, device=DEVICE)
    wide[:, : meta.block_tables.shape[1]] = meta.block_tables
    replay = dataclasses.replace(meta, block_tables=wide)
    replay.seq_lens.copy_(torch.tensor(shorter, dtype=torch.int32))
    truth = dataclasses.replace(meta, seq_lens_host=shorter)
    parts = decode_partitions(meta.num_seqs, layer.k.shape[2], wide.shape[1] * 16)
    got = triton_decode_attention(query, layer, replay, SCALE, num_partitions=parts, tile_n=16)
    assert_close(got, torch_reference(query, layer, truth))


def test_partition_rule_uses_static_values_only() -> None:
    """A power of two: many programs already (large batch) -> 1; few -> as many as fill the GPU, bounded by the
    table's width (partitions of >= 256 tokens) and MAX_PARTITIONS."""
    assert decode_partitions(256, 8, 1024) == 1
    assert decode_partitions(64, 8, 4096) == 4
    assert decode_partitions(16, 8, 16384) == 16
    assert decode_partitions(1, 8, 32768) == MAX_PARTITIONS
    assert decode_partitions(1, 8, 600) == 2  # two partitions of >= 256 tokens fit, not three
    assert decode_partitions(1, 1, 16) == 1
