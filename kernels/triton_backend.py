"""The Triton kernels as an `AttentionImpl`, importing triton only on first use.

CPU processes without triton installed never import it; kernels/backends.py registers the name "triton" only when
the package exists.
Triton decides once, when `triton` is first imported, whether kernels compile for the GPU or run under its
CPU interpreter (TRITON_INTERPRET=1; tests/conftest.py sets it on machines without CUDA). That is Triton's own
switch: nothing here reads the environment.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from pagedserve.kernels.kv_cache import KVDtype, LayerKVCache
from pagedserve.kernels.attention import AttentionImpl, AttentionMetadata, AttentionPlan
from pagedserve.kernels.requirements import Requirements


class TritonUnavailableError(RuntimeError):
    """The Triton implementation cannot run on these tensors (CPU tensors need Triton's interpreter)."""


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernels_interpreted() -> bool:
    """True when the kernels were built by Triton's interpreter (they then run on CPU tensors)."""
    from pagedserve.kernels.triton_attention import INTERPRETED

    return INTERPRETED


@functools.cache
def _capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


class TritonAttention(AttentionImpl[AttentionPlan]):
    requirements = Requirements(
        min_block_size=16, block_size_reason="the Triton attention kernel needs block_size >= 16 (tl.dot's minimum)")

    def __init__(self) -> None:
        # Deferred so that importing pagedserve.kernels never imports triton.
        from pagedserve.kernels.triton_attention import triton_paged_attention
        from pagedserve.kernels.triton_decode_attention import is_decode_step, triton_decode_attention
        from pagedserve.kernels.triton_kv_write import triton_write_kv

        self._attention = triton_paged_attention
        self._decode = triton_decode_attention
        self._is_decode_step = is_decode_step
        self._write_kv = triton_write_kv
        self._interpreted = kernels_interpreted()

    def _check_device(self, tensor: torch.Tensor, cache: LayerKVCache) -> None:
        if tensor.device.type != "cuda":
            if not self._interpreted:
                raise TritonUnavailableError(
                    f"triton attention got {tensor.device.type} tensors but its kernels are compiled for the GPU; use "
                    "attention_backend='torch' on CPU (or TRITON_INTERPRET=1 before triton is imported, for tests)"
                )
        elif cache.dtype == KVDtype.FP8_E4M3 and _capability(tensor.device.index) < (8, 9):
            raise TritonUnavailableError(
                "an fp8_e4m3 KV cache needs compute capability >= 8.9 (Ada, Hopper) for Triton's e4m3 conversions; "
                "use kv_cache_dtype=fp8_e5m2 on this GPU"
            )

    def cuda_graphs(self) -> bool:
        # The grid is (num_tokens // BLOCK_Q + num_seqs, KV heads), BLOCK_Q from max_query_len: no host read of any
        # length, and the KV write skips negative slots.
        return True

    def plan(self, meta: AttentionMetadata, cache: LayerKVCache, window: int | None = None) -> AttentionPlan:
        # The kernel's grid reads query_start_loc on the device: nothing to prepare on the host but the window.
        return AttentionPlan(window)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        self._check_device(key, cache)
        self._write_kv(key, value, cache, slot_mapping)

    def attention(
        self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, plan: AttentionPlan, scale: float
    ) -> torch.Tensor:
        self._check_device(query, cache)
        # Decode-only steps (the ones CUDA graphs capture) take the split-context kernel; prefill and mixed steps
        # the one that tiles prompt chunks.
        attention = self._decode if self._is_decode_step(meta) else self._attention
        return attention(query, cache, meta, scale, plan.window)
