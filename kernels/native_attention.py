"""The CPU serving path of the PagedAttention entry point: torch code, with decode rows in one native call.

Prefill chunks keep the torch implementation's SDPA (large matmuls, where torch is already fast); every decode
row of a step goes through cpu_native.c, which reads K/V blocks in place instead of gathering and upcasting
them. `auto` picks this on CPU whenever the C file builds here, and falls back to pure torch (logging why)
when it cannot.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_native import DecodeBatch, decode_attention, load_library
from pagedserve.kernels.kv_cache import LayerKVCache
from pagedserve.kernels.paged_attention import ATTENTION_IMPLS, AttentionMetadata
from pagedserve.kernels.torch_attention import TorchAttention, _PrefillChunk, prefill_chunks, query_starts


def _decode_batch(meta: AttentionMetadata, starts: list[int]) -> DecodeBatch | None:
    decode = [i for i, q_len in enumerate(meta.query_lens_host) if q_len == 1]
    if not decode:
        return None
    if len(decode) == meta.num_seqs:  # the common decode-only step: no copies
        seq_lens, tables = meta.seq_lens, meta.block_tables
    else:
        index = torch.tensor(decode, dtype=torch.long)
        seq_lens, tables = meta.seq_lens[index], meta.block_tables[index]
    return DecodeBatch(
        rows=torch.tensor([starts[i] for i in decode], dtype=torch.long),
        seq_lens=seq_lens.contiguous(),
        block_tables=tables.contiguous(),
        max_seq_len=max(meta.seq_lens_host[i] for i in decode),
    )


@ATTENTION_IMPLS.register("native")
class NativeCpuAttention(TorchAttention):
    def __init__(self) -> None:
        super().__init__()
        load_library()  # asked for by name, a missing compiler is an error here, not a silent fallback
        self._step: tuple[AttentionMetadata, DecodeBatch | None, tuple[_PrefillChunk, ...]] | None = None

    def attention(self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        assert query.device.type == "cpu", "the native attention runs on CPU tensors only"
        if self._step is None or self._step[0] is not meta:
            starts = query_starts(meta)
            self._step = (meta, _decode_batch(meta, starts), prefill_chunks(meta, cache, starts))
        _, decode, prefill = self._step
        if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype)
        if decode is not None:
            decode_attention(
                query, out, LayerKVCache.by_head(cache.k), LayerKVCache.by_head(cache.v),
                cache.k_scale, cache.v_scale, decode, scale,
            )
        for chunk in prefill:
            self.prefill(query, out, cache, scale, chunk)
        return out
