"""Sliding-window attention in every implementation (torch, native C, Triton) against a dense masked float64
reference, for windows of 1, block_size - 1, block_size, a few blocks, and wider than any context.

Decode rows, whole prompts and prefill chunks that start after cached context are all in the batches, so chunks
cross window edges mid-block. The blocks a window has left behind are then pointed at a block full of NaN, as
after the block manager freed them: an implementation that still reads one produces NaN.
"""

from __future__ import annotations

import pytest
import torch

from attention_cases import BATCHES, DEVICE, SCALE, TOLERANCE, float64_reference, free_out_of_window, make_case
from pagedserve.kernels.attention import check_window
from pagedserve.kernels.backends import ATTENTION_IMPLS, select_attention_impl
from pagedserve.kernels.kv_cache import KVDtype
from pagedserve.kernels.paged_attention import paged_attention

ON_CPU = DEVICE.type == "cpu"
IMPLS = [name for name in ("torch", "native", "triton") if name in ATTENTION_IMPLS and (ON_CPU or name != "native")]
# Longer contexts than the shared batches, so that small windows leave many blocks behind.
BATCHES = {**BATCHES, "long": ((70, 45, 90), (1, 45, 29))}


def windows(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, 2 * block_size + 3, 1000]


def implementation(name: str):
    return ATTENTION_IMPLS.get(name)() if name != "torch" else select_attention_impl("torch", torch.device("cpu"))


def block_sizes(name: str) -> list[int]:
    return [16] if name == "triton" else [8, 16]  # Triton's tl.dot needs block_size >= 16


CASES = [(name, bs, w) for name in IMPLS for bs in block_sizes(name) for w in windows(bs)]


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize(("impl", "block_size", "window"), CASES)
def test_matches_dense_masked_reference(impl: str, block_size: int, window: int, batch: str) -> None:
    seq_lens, query_lens = BATCHES[batch]
    query, layer, meta = make_case(seq_lens, query_lens, block_size, 3, KVDtype.FP32, head_dim=32, seed=window)
    exact = float64_reference(query, layer, meta, window)
    result = paged_attention(implementation(impl), query, layer, meta, SCALE, window=window)
    assert (result.double().cpu() - exact).abs().max().item() < 1e-5


@pytest.mark.parametrize(("impl", "block_size", "window"), [c for c in CASES if c[2] < 1000])
def test_never_reads_blocks_behind_the_window(impl: str, block_size: int, window: int) -> None:
    seq_lens, query_lens = BATCHES["long"]
    query, layer, meta = make_case(seq_lens, query_lens, block_size, 4, KVDtype.FP16, head_dim=32, seed=7)
    exact = float64_reference(query, layer, meta, window)
    freed = free_out_of_window(layer, meta, window)
    assert not torch.equal(freed.block_tables, meta.block_tables)  # some blocks really were left behind
    result = paged_attention(implementation(impl), query, layer, freed, SCALE, window=window)
    assert torch.isfinite(result).all()
    assert (result.double().cpu() - exact).abs().max().item() <= TOLERANCE[torch.float16]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_window_wider_than_every_context_is_full_attention(impl: str) -> None:
    seq_lens, query_lens = BATCHES["mixed"]
    query, layer, meta = make_case(seq_lens, query_lens, 16, 2, KVDtype.BF16, seed=3)
    impl_ = implementation(impl)
    full = paged_attention(impl_, query, layer, meta, SCALE)
    assert torch.equal(paged_attention(impl_, query, layer, meta, SCALE, window=max(seq_lens)), full)


def test_plans_are_made_per_window() -> None:
    query, layer, meta = make_case((40,), (1,), 16, 1, KVDtype.FP32)
    impl = implementation("torch")
    plan = impl.plan(meta, layer, 8)
    assert plan.window == 8
    with pytest.raises(AssertionError, match="plan made for window 8"):
        paged_attention(impl, query, layer, meta, SCALE, plan=plan, window=None)
    with pytest.raises(ValueError, match="positive int"):
        check_window(0)
