"""Native decode attention over an int8 cache computes with integer dots: scores (kernels/cpu/kv_dot.h), each query
head rounded to int16 with one scale, q.k summed exactly in int32; and values (kernels/cpu/kv_values.h), each query's
probabilities times the V row scales rounded to int16 with one scale per key chunk. Every ISA tier (each has its own
dot instructions) against a float64 model of those rules, against the unrounded math within the rules' stated
bounds, and a query holding NaN."""

from __future__ import annotations

import ctypes

import pytest
import torch

import cpu_tiers
from attention_cases import SCALE, make_case
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.structs import DecodeArgs
from pagedserve.kernels.kv_cache import KVDtype

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="cases are built on the GPU when one is present")

# Decode rows past one 512-key chunk, in partial blocks and in a block's first slot.
SEQ_LENS = (600, 33, 1, 97)


def run_tier(tier: str, query: torch.Tensor, layer, meta) -> torch.Tensor:
    batch = cpu_native.DecodeBatch(torch.arange(len(SEQ_LENS)), meta.seq_lens, meta.block_tables.contiguous(),
                                   max(SEQ_LENS))
    out = torch.zeros_like(query)
    args = DecodeArgs(**cpu_native.attention_fields(query, out, layer, batch, SCALE))
    lib = cpu_native.load_library(tier)
    assert lib.pagedserve_decode_attention(ctypes.byref(args), len(SEQ_LENS), max(SEQ_LENS), 2) == 0
    return out


def cached_rows(layer, meta, i: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    """Sequence i's int8 K and V [T, Hkv, D] as stored and their row scales [T, Hkv], in float64."""
    bs = layer.k.shape[1]
    blocks = meta.block_tables[i, : -(-seq_len // bs)].long()
    return tuple(t[blocks].flatten(0, 1)[:seq_len].double()
                 for t in (layer.k, layer.v, layer.k_row_scale, layer.v_row_scale))


def int16_queries(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's rounding, in fp32 as it does it: q = SCALE q, s = max|q| / 32767, q16 = rint(q * (32767 / max))."""
    q = query.float() * torch.tensor(SCALE, dtype=torch.float32)
    amax = q.abs().amax(-1, keepdim=True)
    q16 = torch.round(q * (torch.tensor(32767.0) / amax))  # torch.round: ties to even
    return q16.double(), (amax / torch.tensor(32767.0)).double()


def rounded_values(scores: torch.Tensor, v: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
    """The values rule: per chunk of KEY_CHUNK keys, softmax numerators under the chunk's max times the V row scales,
    rounded to int16 steps of the chunk's largest / 32767; the chunks merged under the global max."""
    chunk, peak = cpu_native.decode_key_chunk(), scores.amax(-1, keepdim=True)
    num, total = torch.zeros(scores.shape[0], v.shape[-1], dtype=torch.float64), 0.0
    for c0 in range(0, scores.shape[1], chunk):
        part = scores[:, c0 : c0 + chunk]
        local = part.amax(-1, keepdim=True)
        w = (part - local).exp() * vs[c0 : c0 + chunk].T
        step = w.amax(-1, keepdim=True) / 32767
        num += torch.einsum("hk,khd->hd", torch.round(w / step) * step, v[c0 : c0 + chunk]) * (local - peak).exp()
        total = total + (part - peak).exp().sum(-1, keepdim=True)
    return num / total


def reference(query, layer, meta, integer: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention over the dequantized cache, with the int16 queries (integer) or the exact ones; and per row
    and head the rule's bound on any score's error, max_t (s / 2) sum_d |k_td|."""
    out, bound = torch.empty(query.shape, dtype=torch.float64), torch.empty(query.shape[:2], dtype=torch.float64)
    q16, s = int16_queries(query)
    group = query.shape[1] // layer.k.shape[2]
    for i, seq_len in enumerate(SEQ_LENS):
        k, v, ks, vs = cached_rows(layer, meta, i, seq_len)
        k, v, ks, vs = (x.repeat_interleave(group, 1) for x in (k, v, ks, vs))
        if integer:
            scores = torch.einsum("hd,khd->hk", q16[i], k) * s[i] * ks.T
        else:
            scores = torch.einsum("hd,khd->hk", query[i].double() * SCALE, k * ks[..., None])
        out[i] = rounded_values(scores, v, vs) if integer else torch.einsum("hk,khd->hd", scores.softmax(-1),
                                                                               v * vs[..., None])
        bound[i] = (s[i, :, 0, None] / 2 * (k * ks[..., None]).abs().sum(-1).T).amax(-1)
    return out, bound


@pytest.mark.parametrize("tier", cpu_tiers.params(cpu_tiers.ALL))
@pytest.mark.parametrize(("queries_per_kv", "block_size", "head_dim"), [
    (3, 16, 64), (4, 32, 128), (1, 8, 48), (3, 16, 80),  # 48, 80: a half 32-lane group, a runtime group count
])
def test_every_tier_scores_with_int16_queries(tier: str, queries_per_kv: int, block_size: int, head_dim: int) -> None:
    """fp32 queries (the native decode step's) with one outlier lane per head, so that the int16 rounding is far
    above fp32's and the two references differ: the kernel must follow the integer one within fp32 noise."""
    query, layer, meta = make_case(SEQ_LENS, (1,) * len(SEQ_LENS), block_size, queries_per_kv, KVDtype.INT8,
                                   head_dim=head_dim, seed=head_dim + queries_per_kv)
    query = query.float()
    query[:, :, 5] *= 300.0  # s = max|q| / 32767 ~ 300 / 32767: the other lanes round to ~1% steps
    got = run_tier(tier, query, layer, meta).double()
    integer, bound = reference(query, layer, meta, integer=True)
    exact, _ = reference(query, layer, meta, integer=False)
    assert (got - integer).abs().max().item() <= 1e-5
    assert (integer - exact).abs().max().item() > 1e-4  # the case tells the two rules apart
    # any output moves by at most (the largest score error) x (the largest spread of V), here far less
    spread = max(cached_rows(layer, meta, i, n)[1].abs().max().item() * cached_rows(layer, meta, i, n)[3].max().item()
                 for i, n in enumerate(SEQ_LENS))
    assert ((got - exact).abs().amax(-1) <= 2 * bound * 2 * spread + 1e-5).all()


@pytest.mark.parametrize("tier", cpu_tiers.params(cpu_tiers.CORE))
def test_a_nan_query_head_gives_nan_only_there(tier: str) -> None:
    query, layer, meta = make_case(SEQ_LENS, (1,) * len(SEQ_LENS), 16, 3, KVDtype.INT8, seed=3)
    query = query.float()
    query[1, 4, 7] = float("nan")
    query[2, 0, 0] = float("inf")
    query[3] = 0.0  # a zero query: uniform attention, no division by its zero scale
    got = run_tier(tier, query, layer, meta)
    bad = torch.zeros(query.shape[:2], dtype=torch.bool)
    bad[1, 4] = bad[2, 0] = True
    assert torch.isnan(got[bad]).all() and torch.isfinite(got[~bad]).all()
    _, v, _, vs = cached_rows(layer, meta, 3, SEQ_LENS[3])
    assert torch.allclose(got[3].double(), (v * vs[..., None]).mean(0).repeat_interleave(3, 0), atol=1e-5)
