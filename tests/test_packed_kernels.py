"""The packed GGUF kernels (kernels/cpu/packed_linear.c) against gguf's own dequantizers, in every compiled variant.

Bounds: dequantized rows equal `gguf.quants.dequantize` exactly (fp32) and its bf16 rounding (bf16). The fp32
product (the default) is x @ W^T within fp32 summation error: 1e-5 of |x| @ |W|^T, computed in float64. The int8
variant rounds activations per 32 values (x ~ a q, |x - a q| <= a / 2), so it is checked twice: against the same
rounding emulated in numpy, x_q @ W^T, within fp32 summation error (1e-4 of |x_q| @ |W|^T); and against the exact
x @ W^T within the rounding's own bound, sum_i |W_i| a_i / 2 (+ that summation error).
The interleaved-rows kernel (kernels/cpu/packed_grouped.c) is exact in fp32 up to summation order in its AVX-512 fp32 and
portable builds; its AVX512-VNNI, AVX-VNNI and AVX2 builds round x to int16 per 32 values (a = max|x| / 32767) but keeps exact fp32
block sums for the offset term (kernels/cpu/act_q16.h): |y - x W^T| <= sum_k (a_k / 2) |d u_k| (+ the fp32 bound),
d u = w - m per block; those three builds give the same result bit for bit.
The builds: -march=native and every ISA tier this host runs (kernels/cpu/isa.py), each compiled with exactly its
tier's flags: avx512 is the interleaved rows' fp32 AVX-512 kernel, avx2_vnni / avx2 the AVX-VNNI and AVX2 dots
(both kernels), portable plain C.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K, dequantize, quantize

import cpu_tiers
from gguf_fixtures import random_k_blocks
from pagedserve.engine.loading.gguf_file import GgufFile
from pagedserve.engine.loading.model_store import gemma3_270m_gguf, resolve_model
from pagedserve.kernels.cpu import isa
from pagedserve.kernels.cpu import packed as cpu_packed
from pagedserve.quant import gguf as gguf_method
from pagedserve.quant.gguf import GgufLinearMethod

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


def blocks_for(qtype: str, out: int, inn: int, rng: np.random.Generator) -> np.ndarray:
    """Random weights in `qtype`: gguf's quantizer where it has one, random K blocks (finite scales) otherwise."""
    if qtype.endswith("_K"):
        return random_k_blocks((out, inn), T[qtype], rng, scale=2e-3)
    return quantize(rng.standard_normal((out, inn)).astype(np.float32), T[qtype])


def quantized_activations(x: np.ndarray, top: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's int8 (top 127; int16: 32767) rounding of x [rows, in] emulated in float32: (a q as float64, a
    per value)."""
    runs = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(runs).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(top) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(runs * inv)
    scale = (amax / np.float32(top)).astype(np.float32)
    return (q * scale).astype(np.float64).reshape(x.shape), np.broadcast_to(scale, runs.shape).reshape(x.shape)


def check_product(matrix: cpu_packed.PackedMatrix, weights: np.ndarray, x: torch.Tensor) -> None:
    """Both variants of matrix's product: fp32 activations (x @ W^T within fp32 summation error) and int8 ones."""
    w = weights.astype(np.float64)
    xn = x.numpy()
    exact = np.abs(xn).astype(np.float64) @ np.abs(w).T
    y = matrix.matmul(x).numpy().astype(np.float64)
    np.testing.assert_array_less(np.abs(y - xn.astype(np.float64) @ w.T), 1e-5 * exact + 1e-5)
    rounded = cpu_packed.PackedMatrix(matrix.qtype, matrix.blocks, matrix.in_features, lib=matrix.lib,
                                      int8_max_rows=1 << 30)
    y = rounded.matmul(x).numpy().astype(np.float64)
    xq, scale = quantized_activations(xn)
    summation = 1e-4 * (np.abs(xq) @ np.abs(w).T) + 1e-5
    np.testing.assert_array_less(np.abs(y - xq @ w.T), summation)
    rounding = (scale / 2) @ np.abs(w).T
    np.testing.assert_array_less(np.abs(y - xn.astype(np.float64) @ w.T), rounding * 1.001 + summation)


def run_offsets(qtype: str, stored: np.ndarray, rows: int) -> np.ndarray:
    """Each 32-value run's offset m (w = d u + m) of `stored` [rows, bytes], as the int16 kernels split w: -8 d
    (Q4_0), the stored m (Q4_1), -16 d (Q5_0), -dmin mn (Q4_K, Q5_K: gguf's own scale decoding), 0 for the signed
    codes (Q8_0, Q6_K's u - 32)."""
    _, per, size = cpu_packed.FORMATS[qtype]
    raw = stored.view(np.uint8).reshape(rows, -1, size)
    half = lambda at: raw[:, :, at:at + 2].copy().view(np.float16)[..., 0].astype(np.float64)  # noqa: E731
    if qtype in ("Q4_K", "Q5_K"):
        _, mins = Q4_K.get_scale_min(raw[:, :, 4:16].reshape(-1, 12))
        return -(half(2)[..., None] * mins.reshape(rows, -1, 8)).reshape(rows, -1)
    if qtype in ("Q8_0", "Q6_K"):
        return np.zeros((rows, raw.shape[1] * per // 32))
    return {"Q4_0": -8 * half(0), "Q4_1": half(2), "Q5_0": -16 * half(0)}[qtype]


def grouped_bound(matrix: cpu_packed.PackedMatrix, stored: np.ndarray, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """What the interleaved layout's product may differ from x @ W^T by, per output [rows, out]: fp32 summation
    error, and in the int16 builds (INT16_GROUPED_ISAS) the rounding of x, sum_k (a_k / 2) |d u_k| (with 0.1% for a's own
    rounding), d u = w - m per 32-value run (run_offsets)."""
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-5
    if cpu_packed.grouped_isa(matrix.lib, matrix.qtype) not in cpu_packed.INT16_GROUPED_ISAS:
        return bound
    code_terms = np.abs(w - np.repeat(run_offsets(matrix.qtype, stored, w.shape[0]), 32, axis=1))
    _, scale = quantized_activations(x, 32767)
    return bound + 1.001 * ((scale.astype(np.float64) / 2) @ code_terms.T)


def gguf_layer(method: GgufLinearMethod, stored: np.ndarray, out: int, inn: int, dtype: torch.dtype,
               bias: torch.Tensor | None = None) -> torch.nn.Module:
    """A layer `method` loaded with the file's blocks `stored` ([out, row bytes]), as the model loader does."""
    layer = torch.nn.Module()
    layer.in_features, layer.out_features = inn, out
    method.create_weights(layer, inn, out, bias is not None, dtype)
    layer.weight.data.copy_(torch.from_numpy(stored))
    if bias is not None:
        layer.bias.data.copy_(bias)
    method.process_weights_after_loading(layer)
    return layer


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


@pytest.mark.parametrize("tier", cpu_tiers.params(("native", "avx2", "avx2_vnni", "avx512_vnni", "portable")))
def test_auto_keeps_a_dense_copy_only_where_the_packed_kernel_loses(tier, monkeypatch):
    """`--gguf-weights auto` (dense_batches): where the packed build has a many-row form (MANY_ROW_GROUPED_ISAS: the
    AVX2 and AVX-512 int16 builds) the layer serves prefill-sized calls from its blocks and holds no expanded copy;
    elsewhere the copy serves them."""
    lib = cpu_packed.build(None if tier == "native" else tier)
    monkeypatch.setattr(cpu_packed, "build", lambda tier=None: lib)  # what a host of this tier would load
    rng = np.random.default_rng(8)
    stored = blocks_for("Q4_K", 48, 256, rng)
    method = GgufLinearMethod("Q4_K", dense_batches=True)
    layer = gguf_layer(method, stored, 48, 256, torch.float32)
    many = cpu_packed.grouped_isa(lib, "Q4_K") in cpu_packed.MANY_ROW_GROUPED_ISAS
    int16 = ("avx2", "avx2_vnni", "avx512_vnni", "avx512_bf16")
    assert many == (tier in int16 or (tier == "native" and isa.host_tier() in int16))
    assert (layer.__dict__["dense_copy"] is None) == many
    x = torch.randn(40, 256)
    if many:
        assert torch.equal(method.apply(layer, x), layer.packed.matmul(x))
    else:
        expected = x @ torch.from_numpy(dequantize(stored, T["Q4_K"])).T
        torch.testing.assert_close(method.apply(layer, x), expected, atol=1e-4, rtol=1e-4)


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


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("out", [45, 48])
def test_the_ps_linear_fn_pointer_computes_the_same_product(out, qtype):
    """What the native layer loop calls: kernels/cpu/linear.h's ps_linear_fn through the NativeLinear address. 48
    rows are whole groups, so the loader interleaves them where the build has a fast kernel for the format's
    layout (45: the file's layout, whatever the build), and the native step's batch limit follows that kernel."""
    rng = np.random.default_rng(3)
    inn = 256
    stored = blocks_for(qtype, out, inn, rng)
    method = GgufLinearMethod(qtype)
    layer = gguf_layer(method, stored, out, inn, torch.float32, bias=torch.randn(out))
    isa_of = cpu_packed.grouped_isa(layer.packed.lib, qtype)
    fast = isa_of in cpu_packed.FAST_GROUPED_ISAS
    assert layer.packed.row_group == (cpu_packed.GROUP_ROWS if out % 16 == 0 and fast else 0)
    native = method.native_linear(layer)
    wide = qtype in cpu_packed.WIDE_GROUPED_FORMATS
    assert native.native_max_batch == (2 if not layer.packed.row_group else 8 if wide or isa_of != "avx512_vnni"
                                       else 16)
    fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)(native.fn)
    x = torch.randn(5, inn)
    y = torch.empty(5, out)
    assert fn(native.state, x.data_ptr(), 5, y.data_ptr()) == 0
    assert torch.equal(y, layer.packed.matmul(x))
    torch.testing.assert_close(method.apply(layer, x), y)  # decode rows: the packed kernel
    weights = dequantize(stored, T[qtype]).astype(np.float64)
    bound = grouped_bound(layer.packed, stored, weights, x.numpy()) if layer.packed.row_group else \
        1e-5 * (np.abs(x.numpy()).astype(np.float64) @ np.abs(weights).T) + 1e-5
    np.testing.assert_array_less(np.abs(y.numpy() - layer.bias.numpy() - x.numpy() @ weights.T), bound)
    # more rows: the packed kernel still where its build has a many-row form (and no dense copy is made for it),
    # else the dequantized tile and torch's matmul, the same function
    big = torch.randn(gguf_method.PACKED_MAX_ROWS + 1, inn)
    many = cpu_packed.grouped_isa(layer.packed.lib, qtype) in cpu_packed.MANY_ROW_GROUPED_ISAS
    assert gguf_method.serves_every_row_count(layer.packed) == (many and layer.packed.row_group != 0)
    if gguf_method.serves_every_row_count(layer.packed):
        assert torch.equal(method.apply(layer, big), layer.packed.matmul(big))
        dense = GgufLinearMethod(qtype, dense_batches=True)
        dense.create_weights(layer, inn, out, True, torch.float32)
        layer.weight.data.copy_(torch.from_numpy(stored))
        dense.process_weights_after_loading(layer)
        assert layer.__dict__["dense_copy"] is None
        return
    expected = big @ torch.from_numpy(dequantize(stored, T[qtype])).T + layer.bias
    torch.testing.assert_close(method.apply(layer, big), expected, atol=1e-4, rtol=1e-4)


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


def test_long_chunks_are_dequantized_per_call_where_amx_is_granted(monkeypatch):
    """quant/gguf_prefill.py: from MIN_ROWS bf16 rows, where the packed build has the bf16 scratch and AMX tiles are
    granted, a layer multiplies a per-call bf16 expansion of its blocks (whole or in slabs) with torch's GEMM: the
    dequantized layer's product, and nothing held; fewer rows or fp32 compute stay on the packed kernel."""
    from pagedserve.quant import gguf_prefill

    lib = cpu_packed.build()
    if not gguf_prefill.takes(cpu_packed.PackedMatrix("Q4_K", torch.zeros(16, 144, dtype=torch.uint8), 256,
                                                      lib=lib, row_group=cpu_packed.GROUP_ROWS), 64, torch.bfloat16):
        pytest.skip(f"no AMX tiles or no AVX512-BF16 build here ({isa.host_tier()})")
    rng = np.random.default_rng(12)
    stored = blocks_for("Q6_K", 96, 512, rng)
    method = GgufLinearMethod("Q6_K", dense_batches=True)
    layer = gguf_layer(method, stored, 96, 512, torch.bfloat16, bias=torch.randn(96))
    assert layer.__dict__["dense_copy"] is None
    w = torch.from_numpy(dequantize(stored, T["Q6_K"])).to(torch.bfloat16)
    x = torch.randn(gguf_prefill.MIN_ROWS + 5, 512).to(torch.bfloat16)
    expected = torch.nn.functional.linear(x, w, layer.bias.detach())
    assert torch.equal(method.apply(layer, x), expected)
    monkeypatch.setattr(gguf_prefill, "SLAB_BYTES", 32 * 512 * 2)  # three slabs of 32 rows
    bias = layer.bias.detach()
    slabs = [torch.nn.functional.linear(x, w[i:i + 32], bias[i:i + 32]) for i in range(0, 96, 32)]
    assert torch.equal(method.apply(layer, x), torch.cat(slabs, dim=1))
    few = x[:gguf_prefill.MIN_ROWS - 1]
    assert torch.equal(method.apply(layer, few), layer.packed.matmul(few.float()).to(torch.bfloat16))
    assert torch.equal(method.apply(layer, x.float()), layer.packed.matmul(x.float()))  # fp32 compute: packed
