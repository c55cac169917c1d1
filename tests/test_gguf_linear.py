"""GgufLinearMethod (quant/gguf.py) over the packed kernels: which kernel serves a layer at each row count and
dtype (the packed one, a dense copy, a per-call bf16 expansion), whether the layer holds an expanded copy for it,
and the ps_linear_fn pointer the native layer loop calls; each path's product checked against gguf's own
dequantization within tests/packed_fixtures.py's bounds.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

import cpu_tiers
from packed_fixtures import blocks_for, grouped_bound
from pagedserve.kernels.cpu import isa
from pagedserve.kernels.cpu import packed as cpu_packed
from pagedserve.quant import gguf as gguf_method
from pagedserve.quant.gguf import GgufLinearMethod


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
    limit = 8 if wide else {"avx512_vnni": 16, "avx2": 12}.get(isa_of, 8)
    assert native.native_max_batch == (limit if layer.packed.row_group else 2)
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


def test_long_chunks_are_dequantized_per_call_where_the_host_rule_says(monkeypatch):
    """quant/gguf_prefill.py: from the host rule's rows (AMX's MIN_ROWS here, forced so that every AVX512-BF16 host
    runs it), where the packed build has the bf16 scratch, a layer multiplies a per-call bf16 expansion of its
    blocks (whole or in slabs) with torch's GEMM: the dequantized layer's product, and nothing held; fewer rows or
    fp32 compute stay on the packed kernel."""
    from pagedserve.quant import gguf_prefill

    if not cpu_packed.grouped_bf16_available(cpu_packed.build()):
        pytest.skip(f"no AVX512-BF16 build here ({isa.host_tier()})")
    monkeypatch.setattr(gguf_prefill, "host_rule", lambda lib: gguf_prefill.ExpansionRule(gguf_prefill.MIN_ROWS))
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


def test_the_grouped_scratch_multiplies_as_the_row_major_one(monkeypatch):
    """quant/gguf_prefill.dequantized_linear(grouped=True): the matrix expanded into the dense grouped layout and
    multiplied by kernels/cpu/dense_gemm.c (whole or in slabs, with the bias) gives the row-major expansion's product
    within bf16's rounding of the output (the two GEMMs sum in different orders, both in fp32)."""
    from pagedserve.quant import dense_native, gguf_prefill

    lib = cpu_packed.build()
    if not cpu_packed.grouped_bf16_available(lib) or dense_native.gemm_isa() not in ("avx512_bf16", "amx"):
        pytest.skip(f"no AVX512-BF16 build here ({isa.host_tier()})")
    rng = np.random.default_rng(13)
    stored = blocks_for("Q4_K", 96, 512, rng)
    method = GgufLinearMethod("Q4_K", dense_batches=True)
    layer = gguf_layer(method, stored, 96, 512, torch.bfloat16, bias=torch.randn(96))
    x = torch.randn(70, 512).to(torch.bfloat16)
    row_major = gguf_prefill.dequantized_linear(layer.packed, x).float()
    torch.testing.assert_close(gguf_prefill.dequantized_linear(layer.packed, x, grouped=True).float(), row_major,
                               rtol=2 ** -7, atol=2 ** -7 * row_major.abs().max().item())
    monkeypatch.setattr(gguf_prefill, "SLAB_BYTES", 32 * 512 * 2)  # three slabs of 32 rows
    torch.testing.assert_close(gguf_prefill.dequantized_linear(layer.packed, x, grouped=True).float(), row_major,
                               rtol=2 ** -7, atol=2 ** -7 * row_major.abs().max().item())


def test_with_amx_calls_below_amx_grouped_rows_take_the_grouped_scratch(monkeypatch):
    """quant/gguf_prefill.host_rule where the process holds AMX tiles (forced here, so every AVX512-BF16 host runs
    it): every format from MIN_ROWS; below AMX_GROUPED_ROWS the layer's product is the grouped scratch's through
    kernels/cpu/dense_gemm.c, from there the row-major one's through torch."""
    from pagedserve.quant import gguf_prefill

    lib = cpu_packed.build()
    if not cpu_packed.grouped_bf16_available(lib):
        pytest.skip(f"no AVX512-BF16 build here ({isa.host_tier()})")
    monkeypatch.setattr(gguf_prefill, "_amx_granted", lambda: True)
    gguf_prefill.host_rule.cache_clear()
    try:
        rule = gguf_prefill.host_rule(lib)
    finally:
        gguf_prefill.host_rule.cache_clear()
    assert rule == gguf_prefill.ExpansionRule(gguf_prefill.MIN_ROWS, grouped_below=gguf_prefill.AMX_GROUPED_ROWS)
    assert rule.covers("Q4_0", gguf_prefill.MIN_ROWS) and not rule.covers("Q6_K", gguf_prefill.MIN_ROWS - 1)
    assert rule.grouped(gguf_prefill.MIN_ROWS) and rule.grouped(gguf_prefill.AMX_GROUPED_ROWS - 1)
    assert not rule.grouped(gguf_prefill.AMX_GROUPED_ROWS)
    smaller = gguf_prefill.ExpansionRule(gguf_prefill.MIN_ROWS, grouped_below=80)  # both sides of it in one layer
    monkeypatch.setattr(gguf_prefill, "host_rule", lambda lib: smaller)
    rng = np.random.default_rng(14)
    stored = blocks_for("Q4_1", 96, 512, rng)
    method = GgufLinearMethod("Q4_1", dense_batches=True)
    layer = gguf_layer(method, stored, 96, 512, torch.bfloat16, bias=torch.randn(96))
    x = torch.randn(90, 512).to(torch.bfloat16)
    assert torch.equal(method.apply(layer, x[:70]), gguf_prefill.dequantized_linear(layer.packed, x[:70], True))
    assert torch.equal(method.apply(layer, x), gguf_prefill.dequantized_linear(layer.packed, x, False))


def test_without_amx_the_k_formats_expand_only_where_the_expansion_timed_faster(monkeypatch):
    """quant/gguf_prefill.measured_rule: the K formats expand from NO_AMX_MIN_ROWS rows where the per-call expansion
    timed MARGIN times faster than the packed kernel there (best of 3 each), else nothing expands; then Q4_K and Q5_K
    start earlier: from GROUPED_EARLY_ROWS through the grouped GEMM where that timed MARGIN times faster (only where
    the GEMM runs AVX512-BF16 dots), else from ROW_MAJOR_EARLY_ROWS where the row-major expansion did. The host's own
    timing gives one of those answers."""
    from pagedserve.quant import gguf_prefill

    lib = cpu_packed.build()
    if not cpu_packed.grouped_bf16_available(lib):
        pytest.skip(f"no AVX512-BF16 build here ({isa.host_tier()})")
    k_formats, early_types = (gguf_prefill.NO_AMX_MIN_ROWS, gguf_prefill.NO_AMX_TYPES), gguf_prefill.EARLY_TYPES
    expanded = gguf_prefill.ExpansionRule(*k_formats)
    row_major = gguf_prefill.ExpansionRule(*k_formats, gguf_prefill.ROW_MAJOR_EARLY_ROWS, early_types)
    grouped = gguf_prefill.ExpansionRule(*k_formats, gguf_prefill.GROUPED_EARLY_ROWS, early_types,
                                         gguf_prefill.NO_AMX_MIN_ROWS)
    assert gguf_prefill.measured_rule(lib, width=512) in (grouped, row_major, expanded, None)
    assert expanded.covers("Q6_K", 256) and not expanded.covers("Q6_K", 255) and not expanded.covers("Q4_0", 4096)
    for early in (row_major, grouped):
        rows = early.early_rows
        assert not expanded.covers("Q4_K", rows) and early.covers("Q4_K", rows) and early.covers("Q5_K", rows)
        assert not early.covers("Q4_K", rows - 1) and not early.covers("Q6_K", rows) and early.covers("Q6_K", 256)
        assert not early.covers("Q4_0", 4096) and not early.covers("Q5_0", rows)
    assert grouped.grouped(64) and grouped.grouped(255) and not grouped.grouped(256) and not row_major.grouped(128)
    with pytest.raises(ValueError, match="early_rows"):
        gguf_prefill.ExpansionRule(64, gguf_prefill.NO_AMX_TYPES, 64, early_types)
    with pytest.raises(ValueError, match="grouped_below"):
        gguf_prefill.ExpansionRule(64, grouped_below=-1)
    # (packed, expanded) seconds: at 256 rows, then grouped at 64 (where the GEMM runs bf16 dots), then row-major
    pays, short = (1.0, 0.79), (1.0, 0.81)
    cases = (((pays, pays), True, grouped), ((pays, short, pays), True, row_major), ((pays, pays), False, row_major),
             ((pays, short, short), True, expanded), ((short,), True, None))
    for timings, dots, rule in cases:
        times = iter([t for pair in timings for t in pair * 3])
        monkeypatch.setattr(gguf_prefill, "_seconds", lambda call: (call(), next(times))[1])
        monkeypatch.setattr(gguf_prefill, "_grouped_gemm_in_bf16", lambda dots=dots: dots)
        assert gguf_prefill.measured_rule(lib, rows=16, width=256, grouped_rows=16, row_major_rows=16) == rule
        assert next(times, None) is None  # no timing taken beyond what the answer needed
    monkeypatch.setattr(gguf_prefill, "host_rule", lambda lib: expanded)
    matrix = cpu_packed.PackedMatrix("Q6_K", torch.zeros(16, 210, dtype=torch.uint8), 256, lib=lib,
                                     row_group=cpu_packed.GROUP_ROWS)
    assert gguf_prefill.takes(matrix, 256, torch.bfloat16) and not gguf_prefill.takes(matrix, 255, torch.bfloat16)
    q4_0 = cpu_packed.PackedMatrix("Q4_0", torch.zeros(16, 18, dtype=torch.uint8), 32, lib=lib,
                                   row_group=cpu_packed.GROUP_ROWS)
    assert not gguf_prefill.takes(q4_0, 4096, torch.bfloat16)
    monkeypatch.setattr(gguf_prefill, "host_rule", lambda lib: grouped)
    q4_k = cpu_packed.PackedMatrix("Q4_K", torch.zeros(16, 144, dtype=torch.uint8), 256, lib=lib,
                                   row_group=cpu_packed.GROUP_ROWS)
    assert gguf_prefill.takes(q4_k, 64, torch.bfloat16) and not gguf_prefill.takes(q4_k, 63, torch.bfloat16)
    assert gguf_prefill.grouped(q4_k, 64) and not gguf_prefill.grouped(q4_k, 256)
    assert not gguf_prefill.takes(q4_k, 64, torch.float32)  # fp32 compute stays packed
    assert gguf_prefill.takes(matrix, 256, torch.bfloat16) and not gguf_prefill.takes(matrix, 255, torch.bfloat16)


def test_the_expansion_rule_benchmark_times_the_three_paths_and_names_the_rule():
    """benchmarks/gguf_expansion_rule.py, the smallest run with AMX denied (so any AVX512-BF16 host takes the no-AMX
    branch): a header naming the CPU, one line per (matrix, rows) with three positive times, and the rule."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if not cpu_packed.grouped_bf16_available(cpu_packed.build()):
        pytest.skip(f"no AVX512-BF16 build here ({isa.host_tier()})")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gguf_expansion_rule.py"
    run = subprocess.run([sys.executable, "-P", str(script), "--no-amx", "--matrices", "k", "--rows", "64", "--repeats",
                          "1", "--threads", "1"], capture_output=True, text=True, timeout=300, check=True)
    head, timed, rule = [json.loads(line) for line in run.stdout.splitlines()]
    assert head["no_amx"] and head["cpu"] and head["gemm_isa"] in ("avx512_bf16", "avx512", "avx2")
    assert (timed["matrix"], timed["out"], timed["in"], timed["rows"]) == ("k", 512, 2048, 64)
    assert min(timed["packed_ms"], timed["grouped_ms"], timed["row_major_ms"]) > 0
    assert rule["rule"] == "None" or rule["rule"].startswith("ExpansionRule(min_rows=256")
