"""The Triton KV-write kernel against the torch path's write (quantize_for_cache + byte scatter): bit-exact.

Triton's CPU interpreter (TRITON_INTERPRET=1, see tests/conftest.py) converts fp32 -> fp8 wrongly when rounding
carries into the exponent (and on ties and subnormals) and truncates fp32 -> bf16; interpreted, the kernel
therefore rounds in fp32 arithmetic before the cast, which is what makes it bit-exact here. The plain-cast path
that compiled GPUs run is checked too, WITHIN ONE EXPONENT STEP under the interpreter (bit-exact on a GPU).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype, LayerKVCache  # noqa: E402
from pagedserve.kernels.backends import ATTENTION_IMPLS, select_attention_impl  # noqa: E402
from pagedserve.kernels.paged_attention import write_kv  # noqa: E402
from pagedserve.kernels.triton_kv_write import triton_write_kv  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"
NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 3, 64, 16, 6


def make_cache(kv_dtype: KVDtype, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> LayerKVCache:
    cache = KVCache(KVCacheSpec(1, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, kv_dtype), NUM_BLOCKS, DEVICE)
    if k_scale is not None:
        cache.set_scales(0, k_scale, v_scale)
    return cache.layers[0]


def write_both(kv_dtype: KVDtype, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, scales=(None, None)):
    caches = []
    for impl in (select_attention_impl("torch", torch.device("cpu")), ATTENTION_IMPLS.get("triton")()):
        layer = make_cache(kv_dtype, *scales)
        write_kv(impl, key.to(DEVICE), value.to(DEVICE), layer, slots.to(DEVICE))
        caches.append(layer)
    return caches


def random_inputs(num_tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    key, value = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    return key, value, slots


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP16, KVDtype.BF16, KVDtype.FP32])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_16_and_32_bit_writes_are_bit_exact(kv_dtype: KVDtype, input_dtype: torch.dtype) -> None:
    key, value, slots = random_inputs(37, input_dtype)
    ref, out = write_both(kv_dtype, key, value, slots)
    assert torch.equal(ref.k.cpu(), out.k.cpu()) and torch.equal(ref.v.cpu(), out.v.cpu())


FP8_SCALES = (torch.tensor([0.01, 0.02, 0.004]), torch.tensor([0.03, 0.005, 0.01]))


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_fp8_writes_are_bit_exact(kv_dtype: KVDtype) -> None:
    """Also under the interpreter: there the kernel rounds in fp32 first (ROUND_IN_FP32), sidestepping its cast."""
    key, value, slots = random_inputs(40, torch.float16, seed=1)
    # Values that the interpreter's own cast gets wrong: carries into the next binade, ties, subnormals.
    key[0, 0, :4] = torch.tensor([-31.07, 0.3125, -1e-5, 3.1e-5]).to(torch.float16) * FP8_SCALES[0][0]
    ref, out = write_both(kv_dtype, key, value, slots, FP8_SCALES)
    assert torch.equal(ref.k.view(torch.uint8).cpu(), out.k.view(torch.uint8).cpu())
    assert torch.equal(ref.v.view(torch.uint8).cpu(), out.v.view(torch.uint8).cpu())


def exponent_step(x: torch.Tensor, kv_dtype: KVDtype) -> torch.Tensor:
    """The width of x's binade, floored at the smallest normal: the largest error the interpreter's bug can make."""
    min_normal = torch.finfo(kv_dtype.torch_dtype).smallest_normal
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(min_normal))))


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_fp8_hardware_cast_path_within_one_exponent_step(kv_dtype: KVDtype) -> None:
    """The code path compiled GPUs run (a plain fp32 -> fp8 cast), checked WITHIN ONE EXPONENT STEP only when
    interpreted: the interpreter's cast rounds ties away from zero, loses the carry into the exponent
    (-31.07 -> -16, where torch and GPUs give -32) and flushes subnormals. On a GPU it must be bit-exact."""
    key, value, slots = random_inputs(40, torch.float16, seed=1)
    ref = make_cache(kv_dtype, *FP8_SCALES)
    write_kv(select_attention_impl("torch", torch.device("cpu")), key.to(DEVICE), value.to(DEVICE), ref, slots.to(DEVICE))
    out = make_cache(kv_dtype, *FP8_SCALES)
    triton_write_kv(key.to(DEVICE), value.to(DEVICE), out, slots.to(DEVICE), round_in_fp32=False)
    if not INTERPRETED:
        assert torch.equal(ref.k.view(torch.uint8), out.k.view(torch.uint8))
        return
    for name, scale, x in (("k", FP8_SCALES[0], key), ("v", FP8_SCALES[1], value)):
        want = getattr(ref, name).reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].float().cpu()
        got = getattr(out, name).reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].float().cpu()
        scaled = x.float() / scale.view(1, -1, 1)  # what both paths round to fp8
        assert ((got - want).abs() <= exponent_step(scaled, kv_dtype)).all(), name
        # Real quantization errors, a wrong scale or a wrong slot would make most elements differ, not a few.
        assert (got == want).float().mean() > 0.8, name
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots] = False
    assert (out.k.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[untouched].float() == 0).all()


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_out_of_range_values_clamp_to_the_largest_finite_fp8(kv_dtype: KVDtype) -> None:
    """Both paths saturate identically; without the clamp torch's e5m2 cast produces inf."""
    key, value, slots = random_inputs(8, torch.float32, seed=2)
    key[0, 0, :4] = torch.tensor([1e9, -1e9, 1e30, -3e5])
    value[1, 2, :2] = torch.tensor([-1e12, 7e4])
    ref, out = write_both(kv_dtype, key, value, slots)
    limit = kv_dtype.fp8_max
    for layer in (ref, out):
        k = layer.k.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].float().cpu()
        v = layer.v.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].float().cpu()
        assert k[0, 0, :4].tolist() == [limit, -limit, limit, -limit]
        assert v[1, 2, :2].tolist() == [-limit, limit]
        assert torch.isfinite(k).all() and torch.isfinite(v).all()


def test_negative_slots_are_padding_and_not_written() -> None:
    key, value, slots = random_inputs(6, torch.float32, seed=3)
    slots[2] = -1
    layer = make_cache(KVDtype.FP32)
    write_kv(ATTENTION_IMPLS.get("triton")(), key.to(DEVICE), value.to(DEVICE), layer, slots.to(DEVICE))
    flat = layer.k.reshape(-1, NUM_KV_HEADS, HEAD_DIM).cpu()
    keep = torch.arange(6) != 2
    assert torch.equal(flat[slots[keep]], key[keep])
    assert int((flat != 0).any(-1).any(-1).sum()) == 5


def test_strided_inputs_from_a_fused_projection() -> None:
    """K and V as column slices of one [T, (Hq + 2 Hkv) D] projection output (non-contiguous rows)."""
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(9, (4 + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen)
    kv_width = NUM_KV_HEADS * HEAD_DIM
    key = qkv[:, 4 * HEAD_DIM : 4 * HEAD_DIM + kv_width].view(9, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, 4 * HEAD_DIM + kv_width :].view(9, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.arange(20, 29)
    for k in (key, key.contiguous()):  # also K rotated/RoPE'd into a fresh tensor while V stays a view
        ref, out = write_both(KVDtype.FP16, k, value, slots)
        assert torch.equal(ref.k.cpu(), out.k.cpu()) and torch.equal(ref.v.cpu(), out.v.cpu())
