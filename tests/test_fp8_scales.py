"""FP8 KV scales: read from every checkpoint naming, calibrated from the first prefill (per head, margins, powers of
two, centred K) and applied on the way back; the loud log lines say which, because a cache with wrong scales still
serves, only worse."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype
from pagedserve.kernels.kv_scales import (
    CalibratingAttention,
    KVScaleError,
    ScaleRule,
    calibrate_scales,
    hadamard,
    scales_from_checkpoint,
    setup_kv_scales,
)
from pagedserve.kernels.backends import select_attention_impl
from pagedserve.kernels.kv_quant import dequantize_from_cache
from pagedserve.kernels.paged_attention import write_kv
from pagedserve.kernels.torch_attention import TorchAttention

CPU = torch.device("cpu")


# -- checkpoint scales -------------------------------------------------------------------------------------

PREFIX = "model.layers.{}.self_attn."


@pytest.mark.parametrize(
    "k_name, v_name",
    [
        ("k_scale", "v_scale"),  # llm-compressor / compressed-tensors kv_cache_scheme, vLLM-style
        ("attn.k_scale", "attn.v_scale"),  # vLLM module naming
        ("k_proj.k_scale", "v_proj.v_scale"),  # NVIDIA ModelOpt
        ("k_proj.output_scale", "v_proj.output_scale"),  # older llm-compressor
    ],
)
@pytest.mark.parametrize("per_head", [False, True])
def test_reads_every_checkpoint_naming(k_name: str, v_name: str, per_head: bool) -> None:
    shape = (2, 1, 1) if per_head else ()  # compressed-tensors keeps per-head scales with trailing unit dims
    tensors = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4), "model.layers.0.self_attn.q_scale": torch.ones(())}
    for layer in range(3):
        tensors[PREFIX.format(layer) + k_name] = torch.full(shape, 0.1 * (layer + 1), dtype=torch.bfloat16)
        tensors[PREFIX.format(layer) + v_name] = torch.full(shape, 0.5 + layer, dtype=torch.float16)
    scales = scales_from_checkpoint(tensors, num_layers=3, num_kv_heads=2, head_dim=4)
    assert scales is not None and scales.source == "checkpoint"
    assert scales.granularity == ("per-KV-head" if per_head else "per-tensor")
    for layer in range(3):
        assert torch.allclose(scales.k[layer], torch.tensor(0.1 * (layer + 1)), rtol=1e-2)
        assert torch.equal(scales.v[layer], torch.full((2 if per_head else 1,), 0.5 + layer))


def test_deprecated_kv_scale_serves_k_and_v_and_channel_scales_reduce_per_head() -> None:
    tensors = {PREFIX.format(0) + "kv_scale": torch.tensor(0.25)}
    scales = scales_from_checkpoint(tensors, num_layers=1, num_kv_heads=2, head_dim=4)
    assert scales.k[0].item() == scales.v[0].item() == 0.25
    channels = torch.tensor([0.1, 0.4, 0.2, 0.3, 0.9, 0.5, 0.6, 0.7])
    tensors = {PREFIX.format(0) + "k_proj.output_scale": channels, PREFIX.format(0) + "v_proj.output_scale": channels}
    scales = scales_from_checkpoint(tensors, num_layers=1, num_kv_heads=2, head_dim=4)
    assert scales.k[0].tolist() == pytest.approx([0.4, 0.9])  # no channel of a head may clip


def test_no_scales_gives_none_and_broken_scales_raise() -> None:
    assert scales_from_checkpoint({"model.embed_tokens.weight": torch.zeros(2)}, 1, 2, 4) is None
    partial = {PREFIX.format(0) + "k_scale": torch.tensor(1.0), PREFIX.format(0) + "v_scale": torch.tensor(1.0)}
    with pytest.raises(KVScaleError, match="layer 1"):
        scales_from_checkpoint(partial, 2, 2, 4)
    wrong = {PREFIX.format(0) + "k_scale": torch.ones(3), PREFIX.format(0) + "v_scale": torch.ones(1)}
    with pytest.raises(KVScaleError, match="3 values"):
        scales_from_checkpoint(wrong, 1, 2, 4)
    zero = {PREFIX.format(0) + "k_scale": torch.tensor(0.0), PREFIX.format(0) + "v_scale": torch.ones(1)}
    with pytest.raises(KVScaleError, match="> 0"):
        scales_from_checkpoint(zero, 1, 2, 4)


def new_cache(dtype: KVDtype = KVDtype.FP8_E4M3, layers: int = 2) -> KVCache:
    return KVCache(KVCacheSpec(layers, 2, 8, 16, dtype), 4)


def test_setup_installs_checkpoint_scales_and_says_so(caplog) -> None:
    cache, impl = new_cache(), TorchAttention()
    tensors = {PREFIX.format(i) + n: torch.tensor([0.5, 2.0]) * (i + 1) for i in range(2) for n in ("k_scale", "v_scale")}
    with caplog.at_level(logging.WARNING):
        assert setup_kv_scales(cache, tensors, impl) is impl
    assert "LOADED FROM CHECKPOINT (per-KV-head, 2 layers)" in caplog.text
    assert cache.layers[1].k_scale.tolist() == [1.0, 4.0]
    assert cache.layers[0].k_rotation is None  # checkpoint scales were measured on unrotated K


def test_setup_without_scales_calibrates_loudly_or_warns_when_told_not_to(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        cache = new_cache()
        impl = setup_kv_scales(cache, {}, TorchAttention())
        assert isinstance(impl, CalibratingAttention)
        assert "CALIBRATING" in caplog.text and "Hadamard" in caplog.text
        assert torch.equal(cache.layers[1].k_rotation, hadamard(8))
        plain = TorchAttention()
        assert setup_kv_scales(new_cache(), {}, plain, calibrate=False) is plain
        assert "NO k/v scales" in caplog.text
    fp16_impl = TorchAttention()
    assert setup_kv_scales(new_cache(KVDtype.FP16), {}, fp16_impl) is fp16_impl


# -- calibration -------------------------------------------------------------------------------------------


def test_calibration_fixes_per_head_scales_on_the_first_write(caplog) -> None:
    cache = new_cache(layers=1)
    impl = CalibratingAttention(select_attention_impl("torch", CPU), cache, ScaleRule(margin=2.0))
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(20, 2, 8, generator=gen) * torch.tensor([1.0, 30.0]).view(1, 2, 1)
    value = torch.randn(20, 2, 8, generator=gen) * 0.01
    layer = cache.layers[0]
    with caplog.at_level(logging.WARNING):
        write_kv(impl, key, value, layer, torch.arange(20))
    assert impl.calibrated and "CALIBRATED from the first prefill (20 tokens, scale = 2 x amax / 448)" in caplog.text
    expected = np.abs(key.numpy()).max(axis=(0, 2)) * 2.0 / 448.0
    assert np.allclose(layer.k_scale.numpy(), expected, rtol=1e-6)
    assert np.allclose(layer.v_scale.numpy(), np.abs(value.numpy()).max(axis=(0, 2)) * 2.0 / 448.0, rtol=1e-6)
    # Stored values come back within e4m3's rounding (3 mantissa bits: relative error <= 2^-4).
    back = dequantize_from_cache(layer.k.reshape(-1, 2, 8)[:20], layer.k_scale, layer.dtype, torch.float32)
    assert ((back - key).abs() <= key.abs() * 2**-4 + 1e-6).all()
    # Later writes never move the scales (stored data depends on them); out-of-range values saturate.
    write_kv(impl, key * 10, value, layer, torch.arange(20, 40))
    assert np.allclose(layer.k_scale.numpy(), expected, rtol=1e-6)
    assert dequantize_from_cache(layer.k.reshape(-1, 2, 8)[20:40], layer.k_scale, layer.dtype, torch.float32).abs().max() <= (
        448.0 * layer.k_scale.max() + 1e-6
    )


_FP8_MAX = {KVDtype.FP8_E4M3: 448.0, KVDtype.FP8_E5M2: 57344.0}


@pytest.mark.parametrize("dtype", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
@pytest.mark.parametrize("rule", [ScaleRule(), ScaleRule(margin=1.25), ScaleRule(margin=8.0, power_of_two=True),
                                  ScaleRule(per_tensor=True), ScaleRule(margin=1.5, power_of_two=True, per_tensor=True)])
def test_scale_rule_matches_a_numpy_reference(dtype: KVDtype, rule: ScaleRule) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 3, 16, generator=gen) * torch.tensor([0.02, 5.0, 300.0]).view(1, 3, 1)
    amax = np.abs(x.numpy().astype(np.float64)).max(axis=(0, 2))
    if rule.per_tensor:
        amax = np.full_like(amax, amax.max())
    expected = rule.margin * amax / _FP8_MAX[dtype]
    if rule.power_of_two:
        expected = np.exp2(np.ceil(np.log2(expected)))
    assert np.allclose(calibrate_scales(x, dtype, rule).numpy(), expected, rtol=1e-6)


def test_margin_one_keeps_the_calibration_batch_unclipped_and_saturates_beyond_it() -> None:
    """With scale = amax / fp8_max the largest calibrated value maps to fp8_max exactly; a later value twice as large
    saturates to it instead of becoming inf or NaN (both cache dtypes, the CPU cast would give inf for e5m2)."""
    gen = torch.Generator().manual_seed(4)
    first = torch.randn(64, 2, 8, generator=gen)
    for dtype in (KVDtype.FP8_E4M3, KVDtype.FP8_E5M2):
        scale = calibrate_scales(first, dtype, ScaleRule(margin=1.0))
        back = _stored_back(first, scale, dtype)
        amax = first.abs().amax(dim=(0, 2))
        assert torch.allclose(back.abs().amax(dim=(0, 2)), amax, rtol=1e-6)
        beyond = _stored_back(first * 2, scale, dtype)
        assert torch.isfinite(beyond).all() and torch.allclose(beyond.abs().amax(dim=(0, 2)), amax, rtol=1e-6)


def test_scale_rule_rejects_a_bad_margin() -> None:
    for margin in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(KVScaleError, match="margin"):
            ScaleRule(margin=margin)


def _stored_back(values: torch.Tensor, scale: torch.Tensor, dtype: KVDtype) -> torch.Tensor:
    layer = KVCache(KVCacheSpec(1, 2, 8, 16, dtype), 4).layers[0]
    layer.k_scale.copy_(scale)
    write_kv(TorchAttention(), values, values, layer, torch.arange(values.shape[0]))
    return dequantize_from_cache(layer.k.reshape(-1, 2, 8)[: values.shape[0]], layer.k_scale, dtype, torch.float32)


@pytest.mark.parametrize("dtype", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_power_of_two_scales_keep_the_rounding_grid_whatever_the_first_batch(dtype) -> None:
    """First batches with different maxima give scales under which every later value in FP8's normal range comes
    back bit-identical: the batch chose the range, not the rounding. The exact-amax rule moved the rounding."""
    gen = torch.Generator().manual_seed(1)
    first = torch.randn(32, 2, 8, generator=gen)
    later = torch.randn(64, 2, 8, generator=gen) * 0.7
    factors = (1.0, 1.37, 2.9)
    scales = [calibrate_scales(first * f, dtype, ScaleRule(margin=8.0, power_of_two=True)) for f in factors]
    assert all(torch.equal(s, torch.exp2(torch.round(torch.log2(s)))) for s in scales)
    largest = torch.stack(scales).amax(dim=0).view(1, 2, 1)
    normal = later.abs() / largest >= torch.finfo(dtype.torch_dtype).smallest_normal  # below: subnormal spacing
    assert normal.float().mean() > 0.9
    pow2 = [_stored_back(later, s, dtype)[normal] for s in scales]
    assert torch.equal(pow2[0], pow2[1]) and torch.equal(pow2[0], pow2[2])
    amax = first.abs().amax(dim=(0, 2))
    exact = [_stored_back(later, amax * f * 16 / dtype.fp8_max, dtype)[normal] for f in factors]
    assert not torch.equal(exact[0], exact[1])


def test_calibration_with_center_k_stores_the_first_batch_centred() -> None:
    cache = new_cache(layers=1)
    impl = CalibratingAttention(select_attention_impl("torch", CPU), cache, ScaleRule(margin=2.0, center_k=True))
    gen = torch.Generator().manual_seed(6)
    key = torch.randn(20, 2, 8, generator=gen) + torch.tensor([5.0, -3.0]).view(1, 2, 1)
    layer = cache.layers[0]
    write_kv(impl, key, key.clone(), layer, torch.arange(20))
    mean = key.numpy().mean(axis=0)
    assert np.allclose(layer.k_offset.numpy(), mean, atol=1e-6)
    assert np.allclose(layer.k_scale.numpy(), np.abs(key.numpy() - mean).max(axis=(0, 2)) * 2.0 / 448.0, rtol=1e-5)
    back = dequantize_from_cache(layer.k.reshape(-1, 2, 8)[:20], layer.k_scale, layer.dtype, torch.float32)
    centred = key - layer.k_offset
    assert ((back - centred).abs() <= centred.abs() * 2**-4 + 1e-6).all()
    write_kv(impl, key, key, layer, torch.arange(20, 40))  # later writes are centred by the entry point
    assert torch.equal(layer.k.reshape(-1, 2, 8)[20:40].view(torch.uint8), layer.k.reshape(-1, 2, 8)[:20].view(torch.uint8))
    setup_kv_scales(cache, {}, TorchAttention())
    assert layer.k_offset is None  # a fresh calibration starts without the old offset


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_matches_torch_cast_for_every_fp8_byte(kv_dtype: KVDtype, out_dtype: torch.dtype) -> None:
    """The torch path's CPU fast path for e4m3 (bit rearrangement into fp16) must equal torch's own cast."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_dtype.torch_dtype)
    every = every[torch.isfinite(every.float())]  # stores clamp, so the cache never holds NaN or inf
    x = every.repeat(6).view(-1, 3, 1).expand(-1, 3, 4).contiguous()  # [T, Hkv=3, D=4]
    scale = torch.tensor([0.013, 1.7, 3e-3])
    want = (x.float() * scale.view(1, -1, 1)).to(out_dtype)
    assert torch.equal(dequantize_from_cache(x, scale, kv_dtype, out_dtype), want)
