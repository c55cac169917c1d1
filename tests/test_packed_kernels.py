"""The packed GGUF kernels (kernels/cpu/packed_linear.c) against gguf's own dequantizers, in every compiled variant.

Dequantized rows equal `gguf.quants.dequantize` exactly (fp32) and its bf16 rounding (bf16); products stay within
tests/packed_fixtures.py's bounds. The interleaved-rows kernel (kernels/cpu/packed_grouped.c) gives the same result
bit for bit in its AVX512-VNNI, AVX-VNNI and AVX2 builds.
The builds: -march=native and every ISA tier this host runs (kernels/cpu/isa.py), each compiled with exactly its
tier's flags: avx512 is the interleaved rows' fp32 AVX-512 kernel, avx2_vnni / avx2 the AVX-VNNI and AVX2 dots
(both kernels), portable plain C.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

import cpu_tiers
from packed_fixtures import blocks_for, check_product, grouped_bound
from pagedserve.engine.loading.gguf_file import GgufFile
from pagedserve.engine.loading.model_store import gemma3_270m_gguf, resolve_model
from pagedserve.kernels.cpu import isa
from pagedserve.kernels.cpu import packed as cpu_packed

# tier -> what its row kernel's integer dot and its interleaved-rows kernel compile to
EXPECTED_ISAS = {"portable": ("portable", "portable"), "avx2": ("avx2", "avx2"),
                 "avx2_vnni": ("avx2_vnni", "avx2_vnni"), "avx512": ("avx2", "avx512"),
                 "avx512_vnni": ("avx512_vnni", "avx512_vnni"), "avx512_bf16": ("avx512_vnni", "avx512_vnni")}
FORMATS = tuple(cpu_packed.FORMATS)
# tier -> what the interleaved-rows kernels of Q5_0 and the K formats compile to (packed_grouped_wide.c: the 8-lane
# int16 builds share one kernel; portable C where there is no AVX2, so loaders keep the file's layout)
EXPECTED_WIDE_ISAS = {"portable": "portable", "avx2": "avx2", "avx2_vnni": "avx2_vnni", "avx512": "avx512",
                      "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_vnni"}
ROWS = (1, 2, 3, 7, 16, 33)


@pytest.fixture(scope="module", params=cpu_tiers.params(cpu_tiers.ALL))
def lib(request):
    built = cpu_packed.build(request.param)
    tier = isa.host_tier() if request.param == "native" else request.param
    assert (cpu_packed.isa(built), cpu_packed.grouped_isa(built)) == EXPECTED_ISAS[tier]
    assert cpu_packed.grouped_isas(built) == {q: EXPECTED_WIDE_ISAS[tier] if q in cpu_packed.WIDE_GROUPED_FORMATS
                                              else EXPECTED_ISAS[tier][1] for q in FORMATS}
    return built


@pytest.mark.parametrize("qtype", FORMATS)
def test_dequantized_rows_equal_gguf(lib, qtype):
    rng = np.random.default_rng(1)
    inn = 512 if qtype.endswith("_K") else 96
    stored = blocks_for(qtype, 37, inn, rng)
    reference = dequantize(stored, T[qtype]).astype(np.float32)
    matrix = cpu_packed.PackedMatrix(qtype, torch.from_numpy(stored.copy()), inn, lib=lib)
    assert np.array_equal(matrix.dequantize().numpy(), reference)
    ids = torch.tensor([36, 0, 5, 5])
    bf16 = matrix.dequantize(ids, torch.bfloat16)
    assert torch.equal(bf16, torch.from_numpy(reference)[ids].to(torch.bfloat16))
    with pytest.raises(IndexError, match="row id"):
        matrix.dequantize(torch.tensor([37]))


@pytest.mark.parametrize("qtype", FORMATS)
def test_product_on_odd_shapes(lib, qtype):
    """Odd output counts, every tile remainder of the row loop, and rows longer than one 64-run segment."""
    rng = np.random.default_rng(2)
    for inn in ((256, 2304) if qtype.endswith("_K") else (96, 2336)):
        stored = blocks_for(qtype, 37, inn, rng)
        weights = dequantize(stored, T[qtype]).astype(np.float32)
        bias = torch.randn(37)
        matrix = cpu_packed.PackedMatrix(qtype, torch.from_numpy(stored.copy()), inn, bias, lib=lib)
        for rows in ROWS:
            x = torch.randn(rows, inn) * torch.rand(rows, 1) * 3
            x[0, :32] = 0.0  # an all-zero run (scale 0)
            y_no_bias = matrix.matmul(x) - bias
            unbiased = cpu_packed.PackedMatrix(qtype, matrix.blocks, inn, lib=lib)
            torch.testing.assert_close(y_no_bias, unbiased.matmul(x), atol=1e-4, rtol=1e-5)
            check_product(unbiased, weights, x)


@pytest.mark.parametrize("qtype", cpu_packed.GROUPED_FORMATS)
def test_grouped_rows_equal_the_file_layout(lib, qtype):
    """The interleaved layout (kernels/cpu/packed_grouped.c, packed_grouped_wide.c): same values as gguf's
    dequantizer, exactly, and the product within grouped_bound, for every activation-row remainder of its 4- and
    8-row passes, with a bias; one block, and many (K formats: several 256-value super-blocks)."""
    rng = np.random.default_rng(4)
    for inn in ((256, 2304) if qtype.endswith("_K") else (96, 2336)):
        stored = blocks_for(qtype, 48, inn, rng)
        weights = dequantize(stored, T[qtype]).astype(np.float32)
        bias = torch.randn(48)
        grouped = cpu_packed.PackedMatrix(qtype, torch.from_numpy(stored.copy()), inn, bias, lib=lib).grouped()
        assert grouped.row_group == cpu_packed.GROUP_ROWS
        assert not np.array_equal(grouped.blocks.numpy(), stored)  # rewritten in place, same size
        assert np.array_equal(grouped.dequantize().numpy(), weights)
        ids = torch.tensor([47, 0, 17, 17])
        assert torch.equal(grouped.dequantize(ids, torch.bfloat16), torch.from_numpy(weights)[ids].to(torch.bfloat16))
        w = weights.astype(np.float64)
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 33):
            x = torch.randn(rows, inn) * torch.rand(rows, 1) * 3
            x[0, :32] = 0.0
            y = grouped.matmul(x).numpy().astype(np.float64) - bias.numpy()
            bound = grouped_bound(grouped, stored, w, x.numpy())
            np.testing.assert_array_less(np.abs(y - x.numpy().astype(np.float64) @ w.T), bound)
        # a row's result does not depend on the rows beside it (a speculating step's rows equal one-row steps)
        full = grouped.matmul(x[:10])
        for rows in range(1, 11):
            assert torch.equal(grouped.matmul(x[:rows]), full[:rows]), rows
        bad = x[:3].clone()
        bad[1, 40] = float("nan")  # a non-finite activation is not rounded away: its row is NaN, the others as before
        y = grouped.matmul(bad)
        assert y[1].isnan().all() and torch.equal(y[[0, 2]], full[[0, 2]])


@pytest.mark.parametrize("qtype", cpu_packed.GROUPED_FORMATS)
def test_many_rows_equal_few_rows(lib, qtype):
    """Prefill-sized calls (the many-row kernel, kernels/cpu/packed_grouped_panel.c, from 8 rows on: every format in
    the AVX2 builds, 4 rows per pass; Q5_0 and the K formats in the avx512_vnni build, packed_grouped_panel16.h, 8,
    4, 2 and 1 rows per pass; chunks of rows and their remainders) give each row exactly what a call of few rows
    gives it, and stay within grouped_bound; two input widths, so two chunk sizes."""
    rng = np.random.default_rng(7)
    for inn, rows in ((256 if qtype.endswith("_K") else 96, 300), (8192, 70)):
        stored = blocks_for(qtype, 32, inn, rng)
        bias = torch.randn(32)
        grouped = cpu_packed.PackedMatrix(qtype, torch.from_numpy(stored.copy()), inn, bias, lib=lib).grouped()
        x = torch.randn(rows, inn) * torch.rand(rows, 1) * 3
        y = grouped.matmul(x)
        assert torch.equal(y, torch.cat([grouped.matmul(x[i:i + 7]) for i in range(0, rows, 7)]))
        assert torch.equal(y[9:18], grouped.matmul(x[9:18]))
        w = dequantize(stored, T[qtype]).astype(np.float64)
        error = np.abs(y.numpy().astype(np.float64) - bias.numpy() - x.numpy().astype(np.float64) @ w.T)
        np.testing.assert_array_less(error, grouped_bound(grouped, stored, w, x.numpy()))


@pytest.mark.parametrize("qtype", cpu_packed.GROUPED_FORMATS)
def test_int16_grouped_builds_agree_bit_for_bit(qtype):
    """avx2, avx2_vnni, avx512 and avx512_vnni round, sum and scale the same way (kernels/cpu/act_q16.h): the interleaved
    rows' products are equal, so an AVX2 host serves exactly what an AVX-512 one does."""
    tiers = [t for t in ("avx512_vnni", "avx512", "avx2_vnni", "avx2") if t in isa.available_tiers()]
    if len(tiers) < 2:
        pytest.skip(f"one int16 tier on this CPU ({tiers})")
    rng = np.random.default_rng(6)
    inn = 2304 if qtype.endswith("_K") else 2336
    stored = blocks_for(qtype, 64, inn, rng)
    x = torch.randn(9, inn) * torch.rand(9, 1) * 3
    bias = torch.randn(64)
    results = {}
    for tier in tiers:
        lib = cpu_packed.build(tier)
        assert cpu_packed.grouped_isa(lib, qtype) == tier
        grouped = cpu_packed.PackedMatrix(qtype, torch.from_numpy(stored.copy()), inn, bias, lib=lib).grouped()
        results[tier] = [grouped.matmul(x[:rows]) for rows in (1, 2, 3, 4, 5, 9)]  # 9: AVX2's many-row kernel
    for tier in tiers[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[tier], results[tiers[0]], strict=True)), tier


def test_grouped_rows_refuse_what_they_cannot_hold(lib):
    rng = np.random.default_rng(5)
    odd = cpu_packed.PackedMatrix("Q4_1", torch.from_numpy(blocks_for("Q4_1", 40, 64, rng)), 64, lib=lib)
    with pytest.raises(ValueError, match="multiple of 16"):
        odd.grouped()
    q5 = torch.from_numpy(blocks_for("Q5_0", 40, 64, rng))
    assert not cpu_packed.PackedMatrix.can_group("Q5_0", q5)
    with pytest.raises(ValueError, match="row_group"):
        cpu_packed.PackedMatrix("Q5_0", q5, 64, lib=lib, row_group=cpu_packed.GROUP_ROWS)
    with pytest.raises(ValueError, match="qtype"):
        cpu_packed.grouped_isa(lib, "Q2_K")
    grouped = cpu_packed.PackedMatrix("Q4_0", torch.from_numpy(blocks_for("Q4_0", 32, 64, rng)), 64, lib=lib).grouped()
    with pytest.raises(ValueError, match="file-layout"):
        grouped.grouped()


def _real_tensors(path, names):
    file = GgufFile(path)  # the loader's reader: gguf's stock one takes seconds over Gemma 3's 262k vocabulary
    return [(info.name, info.qtype.name, np.array(file.data(info.name))) for info in file.infos if info.name in names]


REAL = {
    "smollm2": (lambda: resolve_model(None).weights,
                ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.29.ffn_gate.weight", "token_embd.weight")),
    "gemma3": (gemma3_270m_gguf, ("blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.0.ffn_down.weight",
                                  "blk.0.attn_v.weight", "blk.1.ffn_down.weight", "token_embd.weight")),
}


@pytest.mark.parametrize("model", list(REAL))
def test_real_tensors(model):
    """Every packed type the two shipped files use (SmolLM2: Q4_1, Q8_0; Gemma 3: Q5_0, Q4_K, Q6_K, Q8_0)."""
    path_of, names = REAL[model]
    seen = set()
    for name, qtype, stored in _real_tensors(path_of(), names):
        stored = stored[:3008]  # the embeddings' first rows are plenty (whole groups of 16)
        weights = dequantize(stored, T[qtype]).astype(np.float32)
        inn = weights.shape[1]
        matrix = cpu_packed.PackedMatrix(qtype, torch.from_numpy(stored.copy()), inn)  # grouped() rewrites it
        assert np.array_equal(matrix.dequantize().numpy(), weights), name
        check_product(matrix, weights, torch.randn(3, inn))
        if cpu_packed.PackedMatrix.can_group(qtype, matrix.blocks):
            grouped = matrix.grouped()
            assert np.array_equal(grouped.dequantize().numpy(), weights), name
            x = torch.randn(3, inn)
            bound = grouped_bound(grouped, stored, weights.astype(np.float64), x.numpy())
            error = np.abs(grouped.matmul(x).numpy() - x.numpy().astype(np.float64) @ weights.astype(np.float64).T)
            np.testing.assert_array_less(error, bound)
        seen.add(qtype)
    assert seen == ({"Q4_1", "Q8_0"} if model == "smollm2" else {"Q5_0", "Q4_K", "Q6_K", "Q8_0"})


@pytest.mark.parametrize("qtype", cpu_packed.GROUPED_FORMATS)
def test_grouped_bf16_scratch_equals_the_bf16_rows(lib, qtype):
    """kernels/cpu/packed_grouped_bf16.c (the per-call scratch of quant/gguf_prefill.py): a grouped matrix's groups
    as bf16, in the dense grouped layout and row-major, are packed_dequantize.c's bf16 rows bit for bit, which are
    gguf's dequantization rounded to bf16 (up to the sign of a zero); builds without AVX512-BF16 refuse it."""
    rng = np.random.default_rng(11)
    inn = 512 if qtype.endswith("_K") else 96
    stored = blocks_for(qtype, 64, inn, rng)
    matrix = cpu_packed.PackedMatrix(qtype, torch.from_numpy(stored.copy()), inn, lib=lib)
    out = torch.empty(32, inn, dtype=torch.bfloat16)
    if not cpu_packed.grouped_bf16_available(lib):
        with pytest.raises(ValueError, match="AVX512-BF16"):
            matrix.grouped().dequantize_grouped_bf16(16, 48, out)
        return
    rows = matrix.dequantize(dtype=torch.bfloat16)
    assert torch.equal(rows, torch.from_numpy(dequantize(stored, T[qtype])).to(torch.bfloat16))  # -0 == +0 here
    expected = rows
    grouped = matrix.grouped()
    grouped.dequantize_grouped_bf16(16, 48, out, row_major=True)
    assert torch.equal(out.view(torch.int16), expected[16:48].view(torch.int16))
    grouped.dequantize_grouped_bf16(16, 48, out)
    pairs = expected[16:48].view(2, 16, inn // 2, 2).permute(0, 2, 1, 3).reshape(32, inn)  # dense_layout.py's order
    assert torch.equal(out.view(torch.int16), pairs.contiguous().view(torch.int16))
    with pytest.raises(ValueError, match="whole groups"):
        grouped.dequantize_grouped_bf16(8, 40, out)
