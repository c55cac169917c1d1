"""FP8 KV cache with K rotated (Hadamard) or offset by its mean: exact in fp32, where softmax cannot see either, and
a smaller FP8 error when keys carry an outlier channel, as RoPE'd keys do: the reason the engine rotates K."""

from __future__ import annotations

import torch

from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype
from pagedserve.kernels.kv_scales import calibrate_scales, hadamard
from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.kernels.paged_attention import paged_attention, write_kv
from pagedserve.kernels.torch_attention import TorchAttention


def test_hadamard_is_orthonormal_and_only_for_powers_of_two() -> None:
    h = hadamard(64)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6) and torch.equal(h, h.T)
    assert hadamard(80) is None


def attend(kv_dtype: KVDtype, key, value, query, rotation, offset=None) -> torch.Tensor:
    """One 40-token prefill written and attended through the entry points (which apply the rotation and offset)."""
    cache = KVCache(KVCacheSpec(1, 2, 64, 16, kv_dtype), 3)
    cache.set_k_rotation(rotation)
    cache.layers[0].k_offset = offset
    if kv_dtype.is_fp8:
        stored = key @ (rotation if rotation is not None else torch.eye(64)) - (0 if offset is None else offset)
        cache.set_scales(0, calibrate_scales(stored, kv_dtype), calibrate_scales(value, kv_dtype))
    n = key.shape[0]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([[2, 0, 1]], dtype=torch.int32), slot_mapping=torch.cat([torch.arange(32, 48), torch.arange(24)]),
        max_query_len=n, max_seq_len=n, query_lens_host=(n,), seq_lens_host=(n,),
    )
    impl = TorchAttention()
    write_kv(impl, key, value, cache.layers[0], meta.slot_mapping)
    return paged_attention(impl, query, cache.layers[0], meta, 0.125)


def outlier_case():
    gen = torch.Generator().manual_seed(5)
    key, value = torch.randn(40, 2, 64, generator=gen), torch.randn(40, 2, 64, generator=gen)
    query = torch.randn(40, 8, 64, generator=gen)
    key[:, :, 3] = 30 + torch.randn(40, 2, generator=gen)  # a large, nearly constant channel, as RoPE'd K has
    query[:, :, 3] *= 3
    return key, value, query


def test_rotation_leaves_attention_unchanged_in_fp32() -> None:
    key, value, query = outlier_case()
    plain = attend(KVDtype.FP32, key, value, query, None)
    assert torch.allclose(attend(KVDtype.FP32, key, value, query, hadamard(64)), plain, atol=1e-5)


def test_rotation_reduces_fp8_error_when_keys_have_an_outlier_channel() -> None:
    key, value, query = outlier_case()
    exact = attend(KVDtype.FP32, key, value, query, None)
    errors = {
        name: (attend(KVDtype.FP8_E4M3, key, value, query, rotation) - exact).abs().mean().item()
        for name, rotation in (("plain", None), ("rotated", hadamard(64)))
    }
    assert errors["rotated"] < 0.7 * errors["plain"], errors


def test_k_offset_leaves_attention_unchanged_and_cuts_the_fp8_error_of_offset_keys() -> None:
    """Q.(K - m) shifts all of a query's scores by Q.m, which softmax ignores; FP8 then rounds the smaller K - m."""
    key, value, query = outlier_case()
    offset = key.mean(dim=0)
    exact = attend(KVDtype.FP32, key, value, query, None)
    assert torch.allclose(attend(KVDtype.FP32, key, value, query, None, offset), exact, atol=1e-5)
    assert torch.allclose(attend(KVDtype.FP32, key, value, query, hadamard(64), offset @ hadamard(64)), exact, atol=1e-5)
    plain = (attend(KVDtype.FP8_E4M3, key, value, query, None) - exact).abs().mean().item()
    centred = (attend(KVDtype.FP8_E4M3, key, value, query, None, offset) - exact).abs().mean().item()
    assert centred < 0.7 * plain, (centred, plain)
