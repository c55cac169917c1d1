"""Process-wide allocator settings for CPU serving (glibc malloc), applied once when a CPU engine starts.

A decode step allocates and frees the same large temporaries (gathered K/V, MLP activations, logits) every
layer. glibc returns freed memory above its trim threshold to the OS and serves chunks above its mmap
threshold with fresh mmap calls, so each step pays page faults and zeroing for memory it just released.
Raising both thresholds keeps that memory in the heap for reuse: +11-12% output tok/s on SmolLM2-135M bf16,
2 threads (docs/benchmarks.md). vLLM's CPU backend gets the same effect by preloading tcmalloc.

The same thresholds would keep what loading a model freed (each checkpoint tensor converted, oneDNN packing, the
native step turning packed weights back into plain ones): ~0.3x the weight bytes of a dense checkpoint left
resident for nothing. The entries return it once the engine is built (`release_freed_memory`).
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


def _libc(symbol: str):
    """The C library's `symbol` (a ctypes function), or None where the library or the symbol is missing."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), symbol) if name else None
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Sets the thresholds once per process; False where the C library has no mallopt (not glibc)."""
    global _applied
    if _applied:
        return True
    mallopt = _libc("mallopt")
    if mallopt is None:
        logger.info("no glibc mallopt: allocator thresholds left as they are")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES) == 1
    if not ok:
        logger.warning("mallopt refused the allocator thresholds; step temporaries will be re-mapped each step")
    _applied = ok
    return ok


def release_freed_memory() -> bool:
    """Returns the heap's free pages to the OS now (glibc malloc_trim(0); the thresholds above are unchanged):
    called once by the entries after the engine is built. False where the C library has no malloc_trim."""
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    trim(0)
    return True
