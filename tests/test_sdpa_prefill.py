"""Prefill chunks through SDPA (kernels/prefill_attention.py): a chunk over a cached past runs as two flash calls
(unmasked over the past, causal over the chunk) merged by their log-sum-exps instead of one masked call. A wrong
split or merge would serve wrong tokens silently, so the plan and the values are both checked, against float64 math
and against the masked call it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention_cases import SCALE, TOLERANCE, float64_reference, make_case
from pagedserve.kernels import prefill_attention
from pagedserve.kernels.backends import select_attention_impl
from pagedserve.kernels.kv_cache import KVDtype
from pagedserve.kernels.paged_attention import paged_attention

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="cases are built on the GPU when one is present")

# A whole prompt, chunks after cached context starting mid-block and on a block boundary, and a 2-token chunk.
SEQ_LENS, QUERY_LENS = (300, 77, 129, 96, 40), (300, 50, 2, 32, 37)


@pytest.mark.parametrize("queries_per_kv", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_chunks_over_a_cached_past_agree_with_float64_math(queries_per_kv: int, head_dim: int, monkeypatch) -> None:
    monkeypatch.setattr(prefill_attention, "_SPLIT_MIN_MASK", 0)  # these small chunks split too
    query, layer, meta = make_case(SEQ_LENS, QUERY_LENS, 16, queries_per_kv, KVDtype.FP32, head_dim=head_dim, seed=3)
    torch_impl = select_attention_impl("torch", CPU)
    chunks = torch_impl.plan(meta, layer).prefill
    assert [(c.mask is None, c.seen_by_all) for c in chunks] == [(True, 0), (False, 27), (False, 127), (False, 64),
                                                                 (False, 3)]
    exact = float64_reference(query, layer, meta)
    result = paged_attention(torch_impl, query, layer, meta, SCALE)
    assert (result.double() - exact).abs().max().item() <= 1e-5


def test_the_split_equals_the_masked_call() -> None:
    """fp32, GQA, 2,048 new tokens over 1,000 cached ones: the same values as SDPA with the boolean mask."""
    gen = torch.Generator().manual_seed(4)
    past, new = 1000, 2048
    q = torch.randn(1, 9, new, 64, generator=gen)
    k, v = (torch.randn(1, 3, past + new, 64, generator=gen) for _ in range(2))
    visible = torch.arange(past + new)[None, :] <= torch.arange(past, past + new)[:, None]
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=SCALE, enable_gqa=True)
    split = prefill_attention._past_then_causal(q, k, v, SCALE, past)
    assert split.shape == masked.shape and (split - masked).abs().max().item() <= 1e-6


def test_short_chunks_over_a_short_past_keep_the_mask() -> None:
    """Below _SPLIT_MIN_NEW new tokens and _SPLIT_MIN_MASK queries x keys the two ways do the same products and a
    second flash call costs more than the mask saves; past either a chunk splits, and agrees with float64 math."""
    query, layer, meta = make_case((1100, 900, 4500), (800, 200, 300), 16, 3, KVDtype.FP32, seed=2)
    impl = select_attention_impl("torch", CPU)
    assert 800 >= prefill_attention._SPLIT_MIN_NEW > 300
    assert 300 * 4500 >= prefill_attention._SPLIT_MIN_MASK > 200 * 900
    assert [(c.seen_by_all, c.mask is None) for c in impl.plan(meta, layer).prefill] == [
        (300, False), (0, False), (4200, False)]
    result = paged_attention(impl, query, layer, meta, SCALE)
    assert (result.double() - float64_reference(query, layer, meta)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window, split", [(1000, True), (40, False)])
def test_a_window_keeps_the_mask_unless_every_key_is_in_it(window: int, split: bool, monkeypatch) -> None:
    monkeypatch.setattr(prefill_attention, "_SPLIT_MIN_MASK", 0)
    query, layer, meta = make_case(SEQ_LENS, QUERY_LENS, 16, 3, KVDtype.FP32, seed=6)
    torch_impl = select_attention_impl("torch", CPU)
    chunk = torch_impl.plan(meta, layer, window).prefill[1]  # 50 new tokens over 27 cached
    assert (chunk.seen_by_all, chunk.mask is None) == (27 if split else 0, False)
    exact = float64_reference(query, layer, meta, window)
    result = paged_attention(torch_impl, query, layer, meta, SCALE, window=window)
    assert (result.double() - exact).abs().max().item() <= 1e-5


def test_16_bit_queries_over_a_past_take_one_masked_call(monkeypatch) -> None:
    """bf16 halves would each be rounded before the merge: 16-bit queries keep one SDPA call (the split is never
    reached), and agree with float64 math within one output rounding."""
    monkeypatch.setattr(prefill_attention, "_past_then_causal", None)
    monkeypatch.setattr(prefill_attention, "_SPLIT_MIN_MASK", 0)
    query, layer, meta = make_case(SEQ_LENS, QUERY_LENS, 16, 3, KVDtype.BF16, seed=7)
    exact = float64_reference(query, layer, meta)
    result = paged_attention(select_attention_impl("torch", CPU), query, layer, meta, SCALE)
    assert (result.double() - exact).abs().max().item() <= TOLERANCE[torch.bfloat16]
