"""Corrupted or inconsistent quantized checkpoints fail at load, naming the tensor or field."""

from __future__ import annotations

import pytest
import torch

from quant_fixtures import copy_fixture, load, rewrite_checkpoint, rewrite_config
from pagedserve.engine.errors import ModelLoadError
from pagedserve.quant.base import QuantConfigError
from pagedserve.quant.registry import quant_config_for

GPTQ = "gptq_4bit_g128_actorder_sym"
AWQ = "awq_4bit_g64"
Q = "model.layers.0.self_attn.q_proj"


def _fails(tmp_path, name, match, tensors=None, config=None):
    d = copy_fixture(name, tmp_path / "m")
    if config is not None and (d / "quantize_config.json").exists():
        (d / "quantize_config.json").unlink()  # config.json's copy must be the one that is read
    if tensors is not None:
        rewrite_checkpoint(d, tensors)
    if config is not None:
        rewrite_config(d, lambda c: config(c["quantization_config"]))
    with pytest.raises(ModelLoadError, match=match):
        load(d)


def test_missing_qzeros(tmp_path):
    _fails(tmp_path, GPTQ, rf"{Q}\.qzeros: missing", tensors=lambda t: t.pop(f"{Q}.qzeros"))


def test_missing_g_idx_with_act_order(tmp_path):
    _fails(tmp_path, GPTQ, rf"{Q}\.g_idx: missing", tensors=lambda t: t.pop(f"{Q}.g_idx"))


def test_missing_awq_qzeros(tmp_path):
    _fails(tmp_path, AWQ, rf"{Q}\.qzeros: missing", tensors=lambda t: t.pop(f"{Q}.qzeros"))


def test_wrong_qweight_shape(tmp_path):
    def edit(t):
        t[f"{Q}.qweight"] = t[f"{Q}.qweight"][:-1].clone()
    _fails(tmp_path, GPTQ, rf"{Q}\.qweight: shape \(31, 256\) does not match expected \(32, 256\)", tensors=edit)


def test_wrong_scales_shape_from_a_different_group_size(tmp_path):
    _fails(tmp_path, AWQ, r"model\.layers\.\d+\.\w+\.\w+\.(qzeros|scales): shape \(4, \d+\) does not match expected \(2, ",
           config=lambda q: q.update(group_size=128))


def test_qweight_with_wrong_dtype(tmp_path):
    def edit(t):
        t[f"{Q}.qweight"] = t[f"{Q}.qweight"].to(torch.int64)
    _fails(tmp_path, GPTQ, rf"{Q}\.qweight: dtype torch.int64, expected torch.int32", tensors=edit)


def test_g_idx_out_of_range(tmp_path):
    def edit(t):
        t[f"{Q}.g_idx"] = t[f"{Q}.g_idx"] + 5
    _fails(tmp_path, GPTQ, rf"{Q}\.g_idx: values must lie in \[0, 2\)", tensors=edit)


def test_nan_scales(tmp_path):
    def edit(t):
        t[f"{Q}.scales"][0, 0] = float("nan")
    _fails(tmp_path, AWQ, rf"{Q}\.scales: contains inf or nan", tensors=edit)


def test_unexpected_tensor(tmp_path):
    def edit(t):
        t[f"{Q}.weight"] = torch.zeros(256, 256, dtype=torch.float16)
    _fails(tmp_path, GPTQ, rf"{Q}\.weight: unexpected tensor", tensors=edit)


def test_gemv_layout_under_a_gemm_label(tmp_path):
    # GEMV packs qweight as [out, in/8] (k_proj: [128, 32]; GEMM: [256, 16]): the shape check names it.
    k = "model.layers.0.self_attn.k_proj"

    def edit(t):
        t[f"{k}.qweight"] = torch.zeros(128, 32, dtype=torch.int32)
    _fails(tmp_path, AWQ, rf"{k}\.qweight: shape \(128, 32\) does not match expected \(256, 16\)", tensors=edit)


@pytest.mark.parametrize("name,edit,match", [
    (GPTQ, lambda q: q.update(bits=3), r"quantization_config\.bits: 3 is not supported; supported: \[4, 8\]"),
    (AWQ, lambda q: q.update(bits=8), r"quantization_config\.bits: 8 is not supported for AWQ"),
    (GPTQ, lambda q: q.update(quant_method="bitsandbytes"),
     r"quantization_config\.quant_method: unknown quantization method 'bitsandbytes'; supported: awq, gguf, gptq, none"),
    (AWQ, lambda q: q.update(version="gemv"), r"quantization_config\.version: AWQ 'gemv' checkpoints"),
    (AWQ, lambda q: q.update(version="mystery"), r"quantization_config\.version: 'mystery' is not supported"),
    (GPTQ, lambda q: q.update(checkpoint_format="marlin", format="marlin"),
     r"quantization_config\.checkpoint_format: 'marlin' is not supported; supported: \['gptq', 'gptq_v2'\]"),
    (GPTQ, lambda q: q.update(pack_dtype="int16"), r"quantization_config\.pack_dtype"),
    (GPTQ, lambda q: q.pop("bits"), r"quantization_config\.bits: missing"),
    (GPTQ, lambda q: q.update(group_size="128"), r"quantization_config\.group_size: expected an integer"),
    (GPTQ, lambda q: q.update(desc_act="yes"), r"quantization_config\.desc_act: expected true or false"),
])
def test_bad_config_fields(tmp_path, name, edit, match):
    _fails(tmp_path, name, match, config=edit)


def test_override_must_agree_with_the_checkpoint():
    with pytest.raises(QuantConfigError, match="--quantization 'awq' but the checkpoint says 'gptq'"):
        quant_config_for({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "awq")


def test_override_on_an_unquantized_checkpoint():
    with pytest.raises(QuantConfigError, match="'gptq' requested but the checkpoint has no quantization_config"):
        quant_config_for({}, "gptq")


def test_old_awq_side_file_is_read(tmp_path):
    (tmp_path / "quant_config.json").write_text('{"zero_point": true, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}')
    cfg = quant_config_for({}, None, tmp_path)
    assert (cfg.name, cfg.bits, cfg.group_size, cfg.zero_point) == ("awq", 4, 64, True)


def test_gptqmodel_dynamic_overrides_and_skips():
    cfg = quant_config_for({"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128,
        "dynamic": {r"-:model\.layers\.0\.mlp\..*": {}, r"+:.*down_proj": {"bits": 8, "group_size": 32}}}})
    assert type(cfg.linear_method("model.layers.0.mlp.up_proj")).__name__ == "UnquantizedLinearMethod"
    down = cfg.linear_method("model.layers.1.mlp.down_proj")
    assert (down.spec.bits, down.spec.group_size) == (8, 32)
    assert cfg.linear_method("model.layers.1.self_attn.q_proj").spec.bits == 4
    assert type(cfg.linear_method("lm_head")).__name__ == "UnquantizedLinearMethod"


def test_awq_lm_head_and_listed_modules_stay_unquantized():
    cfg = quant_config_for({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                    "version": "gemm", "modules_to_not_convert": ["visual"]}})
    assert type(cfg.linear_method("model.visual.proj")).__name__ == "UnquantizedLinearMethod"
    assert type(cfg.linear_method("lm_head")).__name__ == "UnquantizedLinearMethod"
    assert type(cfg.linear_method(Q)).__name__ == "AWQLinearMethod"
