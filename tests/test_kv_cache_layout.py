"""The KV cache's head-major storage: kernels see [blocks, block_size, Hkv, D] by strides, the torch path reads
contiguous per-head tiles, and a write lands where both views agree."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype, LayerKVCache
from pagedserve.kernels.backends import select_attention_impl
from pagedserve.kernels.paged_attention import write_kv


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP32, KVDtype.BF16, KVDtype.FP8_E4M3])
def test_storage_is_head_major_under_the_logical_view(kv_dtype: KVDtype) -> None:
    layer = KVCache(KVCacheSpec(2, 3, 8, 16, kv_dtype), num_blocks=5).layers[1]
    assert layer.k.shape == (5, 16, 3, 8)  # what kernels index: [blocks, block_size, Hkv, D]
    storage = LayerKVCache.by_head(layer.k)
    assert storage.shape == (3, 5, 16, 8) and storage.is_contiguous()
    assert storage.data_ptr() == layer.k.data_ptr()  # a view: no copy of the cache
    assert layer.k.stride() == layer.v.stride()


def test_write_lands_in_both_views() -> None:
    cache = KVCache(KVCacheSpec(1, 2, 4, 8, KVDtype.FP32), num_blocks=4)
    layer = cache.layers[0]
    key = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)  # [T, Hkv, D]
    slots = torch.tensor([0, 13, 31])  # block 0 offset 0, block 1 offset 5, block 3 offset 7
    write_kv(select_attention_impl("torch", torch.device("cpu")), key, -key, layer, slots)
    storage = LayerKVCache.by_head(layer.k)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, 8)
        assert torch.equal(layer.k[block, offset], key[t])
        assert torch.equal(layer.v[block, offset], -key[t])
        for head in range(2):
            assert torch.equal(storage[head, block, offset], key[t, head])
    assert int((layer.k != 0).sum()) == int((key != 0).sum())  # nothing else written


def test_a_plain_tensor_is_not_taken_for_cache_storage() -> None:
    with pytest.raises(AssertionError, match="head-major"):
        LayerKVCache.by_head(torch.zeros(4, 16, 2, 8))
