"""`pagedserve calibrate-kv`: scales measured over text files, written as vLLM reads them, and read back by the engine."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from pagedserve.engine.errors import ConfigError
from pagedserve.engine.kv_calibration import SCALES_FILE, KVCalibrationConfig
from pagedserve.kernels.kv_scales import CalibratingAttention
from pagedserve.service.cli import main as cli_main

TOKENS = 120


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> list[Path]:
    """Two calibration texts cut from the Python license committed with the FP8 text set."""
    source = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_texts" / "python-license.txt"
    folder = tmp_path_factory.mktemp("texts")
    out = []
    for n, (start, end) in enumerate(((0, 2500), (6000, 9000))):
        path = folder / f"text{n}.txt"
        path.write_text(source.read_text()[start:end])
        out.append(path)
    return out


def transformers_amax(model_dir: Path, texts: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """The reference: per layer and KV head, max |K| (after RoPE) and |V| from transformers' own KV cache."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    k_amax = v_amax = None
    for path in texts:
        ids = tok(path.read_text(), add_special_tokens=False)["input_ids"][:TOKENS]
        with torch.no_grad():
            cache = model(torch.tensor([ids]), use_cache=True).past_key_values
        keys = np.stack([layer.keys[0].abs().amax(dim=(1, 2)).numpy() for layer in cache.layers])
        values = np.stack([layer.values[0].abs().amax(dim=(1, 2)).numpy() for layer in cache.layers])
        k_amax = keys if k_amax is None else np.maximum(k_amax, keys)
        v_amax = values if v_amax is None else np.maximum(v_amax, values)
    return k_amax, v_amax


def calibrate(model: Path, texts: list[Path], output: Path, *extra: str) -> int:
    args = ["calibrate-kv", "--model", str(model), "--output", str(output), "--max-tokens", str(TOKENS)]
    for path in texts:
        args += ["--text", str(path)]
    return cli_main(args + list(extra))


def test_writes_per_head_scales_as_vllm_reads_them(tiny_llama, texts, tmp_path) -> None:
    out = tmp_path / "calibrated"
    assert calibrate(tiny_llama, texts, out, "--margin", "1.5") == 0
    scales = load_file(str(out / SCALES_FILE))
    assert sorted(scales) == sorted(f"model.layers.{n}.self_attn.{kind}_scale" for n in range(2) for kind in "kv")
    k_amax, v_amax = transformers_amax(tiny_llama, texts)
    for n in range(2):
        assert np.allclose(scales[f"model.layers.{n}.self_attn.k_scale"].numpy(), 1.5 * k_amax[n] / 448.0, rtol=1e-4)
        assert np.allclose(scales[f"model.layers.{n}.self_attn.v_scale"].numpy(), 1.5 * v_amax[n] / 448.0, rtol=1e-4)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["quantization_config"]["kv_cache_scheme"] == {
        "num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False, "symmetric": True}
    assert (out / "model.safetensors").read_bytes() == (tiny_llama / "model.safetensors").read_bytes()


def test_the_engine_uses_the_calibrated_scales(tiny_llama, texts, tmp_path, caplog) -> None:
    out = tmp_path / "calibrated"
    assert calibrate(tiny_llama, texts, out, "--per-tensor", "--kv-cache-dtype", "fp8_e5m2") == 0
    scales = load_file(str(out / SCALES_FILE))
    assert scales["model.layers.1.self_attn.v_scale"].shape == (1,)
    k_amax, _ = transformers_amax(tiny_llama, texts)
    assert np.allclose(scales["model.layers.1.self_attn.k_scale"].numpy(), 4.0 * k_amax[1].max() / 57344.0, rtol=1e-4)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    with caplog.at_level(logging.WARNING):
        eng = LLMEngine(EngineConfig(model=str(out), kv_cache_dtype="fp8_e5m2", kv_cache_memory=1 << 20))
    assert "LOADED FROM CHECKPOINT (per-tensor, 2 layers)" in caplog.text
    assert not isinstance(eng.runner.attn_impl, CalibratingAttention)
    for n, layer in enumerate(eng.runner.kv_cache.layers):
        assert torch.equal(layer.k_scale, scales[f"model.layers.{n}.self_attn.k_scale"].expand(2))
        assert layer.k_rotation is None and layer.k_offset is None
    eng.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()


def test_bad_inputs_name_the_field(tiny_llama, texts, tmp_path) -> None:
    with pytest.raises(ConfigError, match="output"):
        KVCalibrationConfig(model=tiny_llama, output=tiny_llama, texts=tuple(texts))
    with pytest.raises(ConfigError, match="model"):
        KVCalibrationConfig(model=tmp_path, output=tmp_path / "o", texts=tuple(texts))
    with pytest.raises(ConfigError, match="texts"):
        KVCalibrationConfig(model=tiny_llama, output=tmp_path / "o", texts=(tmp_path / "missing.txt",))
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        KVCalibrationConfig(model=tiny_llama, output=tmp_path / "o", texts=tuple(texts), kv_cache_dtype="fp16")
    with pytest.raises(ConfigError, match="kv_cache_dtype: int8 rows carry their own scales"):
        KVCalibrationConfig(model=tiny_llama, output=tmp_path / "o", texts=tuple(texts), kv_cache_dtype="int8")


def test_a_kv_only_compressed_tensors_config_loads_unquantized_weights() -> None:
    from pagedserve.quant.base import QuantConfigError
    from pagedserve.quant.registry import quant_config_for
    from pagedserve.quant.unquantized import UnquantizedConfig

    kv_only = {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": {"num_bits": 8}}
    assert isinstance(quant_config_for({"quantization_config": kv_only}), UnquantizedConfig)
    weights = {**kv_only, "config_groups": {"group_0": {"targets": ["Linear"]}}}
    with pytest.raises(QuantConfigError, match="quant_method"):
        quant_config_for({"quantization_config": weights})
