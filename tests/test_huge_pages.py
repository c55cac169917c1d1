"""The KV cache's host memory (kernels/huge_pages.py): one zeroed buffer, 2 MiB-aligned and advised as huge pages on
Linux, carved into every layer's K, V and row scales without overlap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.kernels import huge_pages
from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(address: int) -> list[str]:
    """VmFlags of the mapping holding address, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_buffer_is_zeroed_aligned_and_advised():
    buf = huge_pages.zeroed_bytes(5 * huge_pages.HUGE_PAGE + 4096)
    assert buf.dtype == torch.uint8 and buf.numel() == 5 * huge_pages.HUGE_PAGE + 4096
    assert buf.data_ptr() % huge_pages.HUGE_PAGE == 0 and not buf.any()
    if THP.exists():  # a kernel built with transparent huge pages records the advice on the mapping ("hg")
        assert "hg" in _vm_flags(buf.data_ptr() + huge_pages.HUGE_PAGE)


def test_a_small_buffer_is_plain_zeros():
    buf = huge_pages.zeroed_bytes(1000)
    assert buf.numel() == 1000 and not buf.any()


def test_carve_refuses_a_view_past_the_buffer_or_misaligned():
    buf = torch.zeros(256, dtype=torch.uint8)
    assert huge_pages.carve(buf, 64, (4, 8), torch.float16).shape == (4, 8)
    with pytest.raises(ValueError, match="do not fit"):
        huge_pages.carve(buf, 192, (8, 8), torch.float16)
    with pytest.raises(ValueError, match="do not fit"):
        huge_pages.carve(buf, 3, (2,), torch.float32)


@pytest.mark.parametrize("dtype", [KVDtype.BF16, KVDtype.INT8, KVDtype.FP8_E4M3, KVDtype.FP32])
def test_every_layer_tensor_is_its_own_zeroed_region_of_one_buffer(dtype):
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=24, block_size=16, dtype=dtype)
    cache = KVCache(spec, num_blocks=700, device="cpu")  # > 2 MiB in all: the huge-page path
    tensors = [t for layer in cache.layers for t in (layer.k, layer.v, layer.k_row_scale, layer.v_row_scale)
               if t is not None]
    assert len(tensors) == 3 * (4 if dtype is KVDtype.INT8 else 2)
    spans = []
    for t in tensors:
        assert not t.view(torch.uint8 if t.dtype.itemsize == 1 else t.dtype).any()
        storage = t.permute(2, 0, 1, 3) if t.dim() == 4 else t.permute(2, 0, 1)
        assert storage.is_contiguous() and t.data_ptr() % 64 == 0
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "pieces overlap"
    # A write into one layer's block lands there only.
    raw = cache.layers[1].v.view(torch.uint8) if dtype.itemsize == 1 else cache.layers[1].v
    raw[5].fill_(1)
    others = [t for t in tensors if t is not cache.layers[1].v]
    assert all(not t.view(torch.uint8 if t.dtype.itemsize == 1 else t.dtype).any() for t in others)
    assert raw[5].all() and not raw[4].any() and not raw[6].any()
