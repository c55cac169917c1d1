"""Host memory for data read in scattered pieces (the paged KV cache): zeroed CPU tensors on transparent huge pages.

Why: decode attention reads each sequence's K/V as 1-4 KiB tiles scattered over the whole cache, so on 4 KiB pages
nearly every tile costs a TLB miss, and in a virtual machine each miss is a two-level (guest and host) page walk.
On the KVM guest of docs/tested-hosts.md native decode attention over scattered bf16 blocks ran 1.01-1.45x faster
from a cache on 2 MiB pages (benchmarks/decode_attention_ab.py --pages 4k huge; docs/kv-cache-formats.md).

Linux gives huge pages to anonymous memory only where asked (transparent_hugepage "madvise", the usual default) or
everywhere ("always"), and only to 2 MiB-aligned ranges first touched after the advice. So the buffer is reserved
untouched, its aligned range advised with MADV_HUGEPAGE, and only then zeroed. The advice is a hint: where the
kernel refuses it (THP "never", no such call, not Linux) the tensor is the same, on 4 KiB pages.
"""

from __future__ import annotations

import ctypes
import math
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


def _advise_huge(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) on [address, address + length); False where the call is unavailable or refused."""
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0


def zeroed_bytes(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed uint8 tensor of nbytes: on CPU, from nbytes >= 2 MiB, starting on a 2 MiB boundary and advised as
    huge pages before first touch; elsewhere (small, or another device) plain torch.zeros."""
    device = torch.device(device)
    if device.type != "cpu" or nbytes < HUGE_PAGE:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    reserved = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # untouched: pages are faulted in by zero_ below
    base = reserved.data_ptr()
    offset = -base % HUGE_PAGE
    _advise_huge(base + offset, nbytes)
    return reserved[offset:offset + nbytes].zero_()


def carve(buffer: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous view of `shape` and `dtype` on buffer's bytes [offset, offset + its size)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if offset % dtype.itemsize or offset + nbytes > buffer.numel():
        raise ValueError(f"{nbytes} bytes at {offset} do not fit a {buffer.numel()}-byte buffer as {dtype}")
    return buffer[offset:offset + nbytes].view(dtype).view(shape)
