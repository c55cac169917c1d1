"""Bit packing and the reference GPTQ/AWQ dequantization, against hand-built words."""

from __future__ import annotations

import pytest
import torch

from pagedserve.quant.packing import (
    AWQ_PACK_ORDER,
    awq_dequantize,
    default_g_idx,
    gptq_dequantize,
    gptq_zeros,
    pack_awq,
    pack_cols,
    pack_rows,
    unpack_awq,
    unpack_cols,
    unpack_rows,
)


def test_unpack_rows_field_order():
    # Word holding 0..7 in fields 0..7 (field i at bits 4i) -> rows 0..7 of one column.
    word = sum(i << (4 * i) for i in range(8))
    packed = torch.tensor([[word - (1 << 32) if word >= 1 << 31 else word]], dtype=torch.int32)
    assert unpack_rows(packed, 4).flatten().tolist() == list(range(8))
    assert unpack_cols(packed, 4).flatten().tolist() == list(range(8))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    g = torch.Generator().manual_seed(bits)
    pf = 32 // bits
    values = torch.randint(0, 1 << bits, (4 * pf, 3 * pf), generator=g, dtype=torch.int32)
    assert torch.equal(unpack_rows(pack_rows(values, bits), bits), values)
    assert torch.equal(unpack_cols(pack_cols(values, bits), bits), values)
    # Top field set -> negative int32, as checkpoints store it.
    top = torch.full((pf, 1), (1 << bits) - 1, dtype=torch.int32)
    assert pack_rows(top, bits).item() == -1


def test_awq_interleave():
    # Natural columns 0..7 holding values 0..7: AWQ puts column AWQ_PACK_ORDER[i] in field i.
    natural = torch.arange(8, dtype=torch.int32).view(1, 8)
    word = pack_awq(natural)
    fields = unpack_cols(word, 4).flatten().tolist()
    assert fields == list(AWQ_PACK_ORDER)
    assert torch.equal(unpack_awq(word), natural)


def test_gptq_v1_zero_wraps_like_the_tools():
    # v1 stores z-1; a true zero of 0 is stored as 15 (4-bit) and must come back as 0, not 16.
    stored = torch.tensor([[15, 7, 0, 3, 0, 0, 0, 0]], dtype=torch.int32)
    assert gptq_zeros(pack_cols(stored, 4), 4, zero_offset=1).flatten().tolist()[:4] == [0, 8, 1, 4]
    assert gptq_zeros(pack_cols(stored, 4), 4, zero_offset=0).flatten().tolist()[:4] == [15, 7, 0, 3]


def _naive_w(q, z, s, g_idx):
    k, n = q.shape
    w = torch.empty(n, k)
    for i in range(k):
        for j in range(n):
            w[j, i] = (q[i, j] - z[g_idx[i], j]) * s[g_idx[i], j].float()
    return w


@pytest.mark.parametrize("bits,group,act_order", [(4, 8, False), (4, 8, True), (8, 16, True), (4, -1, False)])
def test_gptq_dequantize_matches_elementwise_formula(bits, group, act_order):
    g = torch.Generator().manual_seed(3)
    k, n = 32, 16
    q = torch.randint(0, 1 << bits, (k, n), generator=g, dtype=torch.int32)
    g_idx = default_g_idx(k, group)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    groups = int(g_idx.max()) + 1
    z = torch.randint(0, 1 << bits, (groups, n), generator=g, dtype=torch.int32)
    s = (torch.rand(groups, n, generator=g) * 0.1).half()
    v1_zeros = pack_cols((z - 1) & ((1 << bits) - 1), bits)
    w = gptq_dequantize(pack_rows(q, bits), v1_zeros, s, g_idx, bits, zero_offset=1, out_dtype=torch.float32)
    assert torch.equal(w, _naive_w(q, z, s, g_idx))
    w2 = gptq_dequantize(pack_rows(q, bits), pack_cols(z, bits), s, g_idx, bits, zero_offset=0, out_dtype=torch.float32)
    assert torch.equal(w2, w)


def test_awq_dequantize_matches_elementwise_formula():
    g = torch.Generator().manual_seed(4)
    k, n, group = 32, 16, 8
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    z = torch.randint(0, 16, (k // group, n), generator=g, dtype=torch.int32)
    s = (torch.rand(k // group, n, generator=g) * 0.1).half()
    w = awq_dequantize(pack_awq(q), pack_awq(z), s, group, out_dtype=torch.float32)
    assert torch.equal(w, _naive_w(q, z, s, default_g_idx(k, group)))
    sym = awq_dequantize(pack_awq(q), None, s, group, out_dtype=torch.float32)
    assert torch.equal(sym, _naive_w(q, torch.full_like(z, 8), s, default_g_idx(k, group)))
