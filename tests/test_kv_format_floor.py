"""benchmarks/kv_format_floor.py: its simulated e4m3 cache gives back what the engine's FP8 cache stores, and its
int8 and per-token formats round as stated."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bench_paths  # noqa: F401 - puts benchmarks/ on sys.path
import fp8_kv_accuracy as acc
import kv_format_floor as floor
from pagedserve.engine import EngineConfig, LLMEngine
from pagedserve.kernels.kv_quant import dequantize_from_cache


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-floor"))


def _engine(model_dir, kv: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_dtype=kv, kv_cache_memory=8 << 20,
                                  attention_backend="torch", dtype="float32"))


def test_simulated_e4m3_stores_what_the_engines_fp8_cache_stores(tiny_llama) -> None:
    ids = torch.randint(3, 49152, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    real = _engine(tiny_llama, "fp8_e4m3")  # calibrates on its first write, kv_scales.DEFAULT_RULE
    sim = _engine(tiny_llama, "fp32")
    sim.runner.attn_impl = floor.SimulatedKV(sim.runner.attn_impl, sim.runner.kv_cache.layers,
                                             floor.FORMATS["e4m3/head"])
    logits = []
    for engine in (real, sim):
        # the first chunk calibrates, the second is written with the fixed offset and scales and reads both back
        logits.append(torch.cat([acc.run_chunk(engine, ids, 0, 32), acc.run_chunk(engine, ids, 32, len(ids))]))
    slots = torch.arange(len(ids))
    for real_layer, sim_layer in zip(real.runner.kv_cache.layers, sim.runner.kv_cache.layers):
        rotation = real_layer.k_rotation
        stored = dequantize_from_cache(real_layer.k.view(-1, *real_layer.k.shape[2:])[slots], real_layer.k_scale,
                                       real_layer.dtype, torch.float32)
        simulated = sim_layer.k.view(-1, *sim_layer.k.shape[2:])[slots] @ rotation - real_layer.k_offset
        torch.testing.assert_close(simulated, stored, atol=1e-5, rtol=1e-5)
        stored_v = dequantize_from_cache(real_layer.v.view(-1, *real_layer.v.shape[2:])[slots], real_layer.v_scale,
                                         real_layer.dtype, torch.float32)
        torch.testing.assert_close(sim_layer.v.view(-1, *sim_layer.v.shape[2:])[slots], stored_v, atol=0, rtol=0)
    # the same stored values; attention differs only in the order of fp32 arithmetic
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


def test_int8_per_token_rounds_each_row_to_its_own_grid() -> None:
    x = torch.randn(50, 3, 16, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 2, 50).view(-1, 1, 1)
    got = floor.fake_quantize(x, floor.row_scales(x, "int8"), "int8").numpy()
    xn = x.numpy().astype(np.float64)
    step = np.abs(xn).max(axis=-1, keepdims=True) / 127
    np.testing.assert_allclose(got, np.clip(np.round(xn / step), -127, 127) * step, rtol=1e-6, atol=0)
    assert np.all(np.abs(got - xn) <= step / 2 * (1 + 1e-6))  # every row within half its own step


def test_head_scales_saturate_and_fp8_elements_match_torchs_cast() -> None:
    x = torch.tensor([[[-1000.0, -3.3, 0.01, 2.0, 900.0]]])
    scale = torch.tensor(1.0)
    e4m3 = floor.fake_quantize(x, scale, "e4m3")
    assert e4m3[0, 0, 0] == -448 and e4m3[0, 0, -1] == 448
    torch.testing.assert_close(e4m3[0, 0, 1:4], x[0, 0, 1:4].to(torch.float8_e4m3fn).float(), atol=0, rtol=0)
    assert floor.fake_quantize(x, scale, "int8")[0, 0, -1] == 127


@pytest.mark.parametrize("field, kwargs", [("element", {"element": "int4", "scales": "head"}),
                                           ("scales", {"element": "int8", "scales": "block"}),
                                           ("margin", {"element": "int8", "scales": "head", "margin": 0.0})])
def test_bad_format_names_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=field):
        floor.SimFormat(**kwargs)


def test_blocks_ratio_counts_the_per_token_scales() -> None:
    assert floor.FORMATS["e4m3/head"].blocks_ratio(64) == 2.0
    assert floor.FORMATS["int8/token"].blocks_ratio(64) == pytest.approx(2 * 64 / 66)
    assert floor.FORMATS["round-trip-only"].blocks_ratio(64) == 1.0
