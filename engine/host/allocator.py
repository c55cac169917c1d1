"""Process-wide allocator settings for CPU serving (glibc malloc), applied once when a CPU engine starts.

A decode step allocates and frees the same large temporaries (gathered K/V, MLP activations, logits) every
layer. glibc returns freed memory above its trim threshold to the OS and serves chunks above its mmap
threshold with fresh mmap calls, so each step pays page faults and zeroing for memory it just released.
Raising both thresholds keeps that memory in the heap for reuse: +11-12% output tok/s on SmolLM2-135M bf16,
2 threads (docs/benchmarks.md). vLLM's CPU backend gets the same effect by preloading tcmalloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Big enough that no step temporary is ever mmapped or trimmed; the heap then holds the step's peak working set.
KEEP_BYTES = 1 << 30

_applied = False


def keep_freed_memory() -> bool:
    """Sets the thresholds once per process; False where the C library has no mallopt (not glibc)."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        logger.info("no glibc mallopt: allocator thresholds left as they are")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES) == 1
    if not ok:
        logger.warning("mallopt refused the allocator thresholds; step temporaries will be re-mapped each step")
    _applied = ok
    return ok
