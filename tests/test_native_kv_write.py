"""The native KV write (kernels/cpu) against the torch path's store, byte for byte: the cache's bytes are what every
later attention step reads, so a write that rounds or places one value differently changes outputs for the rest of
the sequence; FP8 rounding is checked at every tie, at each ISA tier."""

from __future__ import annotations

import pytest
import torch

import cpu_tiers

from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.kv_cache import KVDtype
from pagedserve.kernels.native_attention import NativeCpuAttention
from pagedserve.kernels.backends import select_attention_impl

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="cases are built on the GPU when one is present")


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP32, KVDtype.BF16, KVDtype.FP16, KVDtype.FP8_E4M3])
def test_write_kv_equals_torch_store(kv_dtype: KVDtype) -> None:
    """The native KV write (compute-dtype caches) leaves the same bytes as the torch path; key rows come strided, as
    slices of the fused projection, and FP8 caches go through the torch path's quantization."""
    from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec

    dtype = QUERY_DTYPES_FOR_WRITE[kv_dtype]
    gen = torch.Generator().manual_seed(11)
    fused = torch.randn(37, 2 + 2 + 4, 64, generator=gen).to(dtype)  # [T, k heads | v heads | other, D]
    key, value = fused[:, 0:2], fused[:, 2:4]
    assert not key.is_contiguous()
    slots = torch.randperm(5 * 16, generator=gen)[:37].to(torch.int64)
    caches = []
    for impl in (select_attention_impl("torch", CPU), NativeCpuAttention()):
        cache = KVCache(KVCacheSpec(1, 2, 64, 16, kv_dtype), 5, CPU).layers[0]
        impl.write_kv(key, value, cache, slots)
        caches.append(cache)
    assert torch.equal(caches[0].k.view(torch.uint8), caches[1].k.view(torch.uint8))
    assert torch.equal(caches[0].v.view(torch.uint8), caches[1].v.view(torch.uint8))


def test_write_kv_refuses_a_slot_outside_the_cache() -> None:
    from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec

    cache = KVCache(KVCacheSpec(1, 2, 64, 16, KVDtype.BF16), 2, CPU).layers[0]
    rows = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(IndexError, match="outside the cache's 32 slots"):
        NativeCpuAttention().write_kv(rows, rows, cache, torch.tensor([3, 32]))
    assert not cache.k.any()  # checked before anything is written


QUERY_DTYPES_FOR_WRITE = {KVDtype.FP32: torch.float32, KVDtype.BF16: torch.bfloat16, KVDtype.FP16: torch.float16,
                          KVDtype.FP8_E4M3: torch.bfloat16}


@pytest.mark.parametrize("tier", cpu_tiers.params(cpu_tiers.CORE))
@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("kv_dtype", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_native_fp8_write_rounds_every_tie_like_torch(kv_dtype: KVDtype, head_dim: int, tier: str,
                                                      monkeypatch) -> None:
    """The native FP8 write (16 lanes at a time, head dim 72's last 8 lanes one by one) against the torch store byte
    for byte at each ISA tier: every finite value of the format, the midpoints between neighbours (ties to even),
    subnormals, values past the range (saturated), zeros and NaN; fp32 rows with scale 1 (exact ties) and bf16 rows
    over a head scale that is not a power of two."""
    from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec

    tier_library = cpu_native.load_library(tier)
    monkeypatch.setattr(cpu_native, "load_library", lambda *_: tier_library)
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_dtype.torch_dtype).float()
    finite = values[values.isfinite()].unique()  # sorted
    mids = (finite[1:] + finite[:-1]) / 2
    extra = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 5e4, -5e4, 1e6, -1e6, float("nan"), float("inf"), -float("inf")])
    flat = torch.cat([finite, mids, mids * 1.0000001, extra])
    rows = torch.nn.functional.pad(flat, (0, -flat.numel() % (2 * head_dim))).view(-1, 2, head_dim)
    for dtype, head_scale in ((torch.float32, 1.0), (torch.bfloat16, 0.37)):
        x = rows.to(dtype) * (head_scale if dtype == torch.bfloat16 else 1.0)
        slots = torch.arange(x.shape[0], dtype=torch.int64)
        caches = []
        for impl in (select_attention_impl("torch", CPU), NativeCpuAttention()):
            cache = KVCache(KVCacheSpec(1, 2, head_dim, 16, kv_dtype), -(-x.shape[0] // 16), CPU).layers[0]
            cache.k_scale.fill_(head_scale), cache.v_scale.fill_(head_scale / 3)
            impl.write_kv(x, -x, cache, slots)
            caches.append(cache)
        assert torch.equal(caches[0].k.view(torch.uint8), caches[1].k.view(torch.uint8))
        assert torch.equal(caches[0].v.view(torch.uint8), caches[1].v.view(torch.uint8))
