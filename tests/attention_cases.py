"""Paged attention test cases shared by the kernel tests: scattered caches filled through the torch path, and a
float64 reference that shares no code with any implementation."""

from __future__ import annotations

import dataclasses

import torch

from pagedserve.kernels.attention import AttentionImpl, AttentionMetadata
from pagedserve.kernels.backends import select_attention_impl
from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype, LayerKVCache
from pagedserve.kernels.kv_quant import dequantize_from_cache
from pagedserve.kernels.kv_scales import hadamard
from pagedserve.kernels.paged_attention import paged_attention, write_kv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_KV_HEADS = 2
SCALE = 0.125

# (seq_lens, query_lens): lengths 1 and exact multiples of both block sizes (32), partial blocks, and for the
# chunked-prefill rows new tokens that start mid-block after cached context.
BATCHES = {
    "decode": ((1, 32, 17, 45), (1, 1, 1, 1)),
    "prefill": ((1, 32, 7, 19), (1, 32, 7, 19)),
    "mixed": ((33, 32, 40, 1, 64), (1, 32, 8, 1, 21)),
}
# fp8 caches are read with fp16 queries: the reference dequantizes the very same fp8 bytes.
QUERY_DTYPES = {
    KVDtype.FP16: torch.float16,
    KVDtype.BF16: torch.bfloat16,
    KVDtype.FP8_E4M3: torch.float16,
    KVDtype.FP8_E5M2: torch.float16,
    KVDtype.FP32: torch.float32,
    KVDtype.INT8: torch.float16,
}
# One output rounding step apart at |out| < 4: fp16's spacing there is 2^-9 ~ 1.95e-3, bf16's is 8x coarser.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def make_case(
    seq_lens: tuple[int, ...], query_lens: tuple[int, ...], block_size: int, queries_per_kv: int,
    kv_dtype: KVDtype, head_dim: int = 64, seed: int = 0, rotate: bool = False,
) -> tuple[torch.Tensor, LayerKVCache, AttentionMetadata]:
    """A cache whose blocks are scattered in random order, filled with every token's K/V by the torch path."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used : used + n]
        used += n
    cache = KVCache(KVCacheSpec(1, NUM_KV_HEADS, head_dim, block_size, kv_dtype), num_blocks, DEVICE)
    cache.set_k_rotation(hadamard(head_dim) if rotate else None)
    if rotate:  # the calibrated layout: K rotated and centred (an offset the entry point subtracts on write)
        cache.layers[0].k_offset = (torch.randn(NUM_KV_HEADS, head_dim, generator=gen) * 0.5).to(DEVICE)
    if kv_dtype.is_fp8:
        k_scale, v_scale = (torch.rand(NUM_KV_HEADS, generator=gen) * 0.02 + 0.005 for _ in range(2))
        cache.set_scales(0, k_scale, v_scale)
    all_slots, new_slots = [], []
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        pos = torch.arange(seq_len)
        slots = tables[i, pos // block_size].long() * block_size + pos % block_size
        all_slots.append(slots)
        new_slots.append(slots[seq_len - q_len :])
    qdtype = QUERY_DTYPES[kv_dtype]
    total = sum(seq_lens)
    k, v = (torch.randn(total, NUM_KV_HEADS, head_dim, generator=gen).to(qdtype) for _ in range(2))
    layer = cache.layers[0]
    torch_impl = select_attention_impl("torch", torch.device("cpu"))
    write_kv(torch_impl, k.to(DEVICE), v.to(DEVICE), layer, torch.cat(all_slots).to(DEVICE))
    query = torch.randn(sum(query_lens), NUM_KV_HEADS * queries_per_kv, head_dim, generator=gen).to(qdtype)
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        slot_mapping=torch.cat(new_slots).to(DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return query.to(DEVICE), layer, meta


def float64_reference(
    query: torch.Tensor, layer: LayerKVCache, meta: AttentionMetadata, window: int | None = None
) -> torch.Tensor:
    """Plain per-sequence attention in float64 over the dequantized cache contents: a dense causal mask, banded to
    the last `window` positions when one is given."""
    out = torch.empty(query.shape, dtype=torch.float64)
    block_size, queries_per_kv = layer.k.shape[1], query.shape[1] // layer.k.shape[2]
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        blocks = meta.block_tables[i, : -(-seq_len // block_size)].long()
        k, v = (
            dequantize_from_cache(c[blocks].flatten(0, 1)[:seq_len], s if rows is None else
                                  rows[blocks].flatten(0, 1)[:seq_len], layer.dtype, query.dtype)
            .double().cpu().repeat_interleave(queries_per_kv, 1)
            for c, s, rows in ((layer.k, layer.k_scale, layer.k_row_scale), (layer.v, layer.v_scale, layer.v_row_scale))
        )
        q = query[start : start + q_len].double().cpu()
        scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
        keys, queries = torch.arange(seq_len)[None, :], torch.arange(seq_len - q_len, seq_len)[:, None]
        hidden = keys > queries
        if window is not None:
            hidden |= keys <= queries - window
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, -torch.inf).softmax(-1), v)
        start += q_len
    return out


def assert_matches_torch(impl: AttentionImpl, query: torch.Tensor, layer: LayerKVCache, meta: AttentionMetadata) -> None:
    """impl's output equals the torch implementation's within one output rounding step."""
    reference = paged_attention(select_attention_impl("torch", torch.device("cpu")), query, layer, meta, SCALE)
    result = paged_attention(impl, query, layer, meta, SCALE)
    assert result.dtype == query.dtype and result.shape == query.shape
    err = (result.float() - reference.float()).abs().max().item()
    assert err <= TOLERANCE[query.dtype], f"max abs err {err}"


def poison_stale_slots(layer: LayerKVCache, meta: AttentionMetadata) -> None:
    """NaN in every cache slot past each sequence's length (stale data of freed or partly filled blocks)."""
    num_blocks, block_size = layer.k.shape[:2]
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=layer.k.device)
    for i, seq_len in enumerate(meta.seq_lens_host):
        pos = torch.arange(seq_len, device=layer.k.device)
        written[meta.block_tables[i, pos // block_size].long() * block_size + pos % block_size] = True
    _poison(layer, ~written.view(num_blocks, block_size))


def _poison(layer: LayerKVCache, where: torch.Tensor | int) -> None:
    """NaN in the slots `where` (a [num_blocks, block_size] mask or a block index); int8 rows get NaN scales."""
    if layer.k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # torch has no masked_fill for FP8: 0x7F is NaN
        layer.k.view(torch.uint8)[where] = 0x7F  # in both formats
        layer.v.view(torch.uint8)[where] = 0x7F
        return
    if layer.k_row_scale is None:
        layer.k[where] = float("nan")  # boolean indexing writes through the cache's strided view
        layer.v[where] = float("nan")
        return
    for rows, scales in ((layer.k, layer.k_row_scale), (layer.v, layer.v_row_scale)):
        rows[where] = 127
        scales[where] = float("nan")


def free_out_of_window(layer: LayerKVCache, meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The block manager's freeing, made observable: table entries of blocks wholly before the first key any new
    token of their sequence sees point at a spare block full of NaN. An implementation that reads one fails."""
    block_size = layer.k.shape[1]
    tables = meta.block_tables.clone()
    spare = sorted(set(range(layer.k.shape[0])) - set(tables.flatten().tolist()))[0]
    _poison(layer, spare)
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        dead = max(0, seq_len - q_len - window + 1) // block_size
        tables[i, :dead] = spare
    return dataclasses.replace(meta, block_tables=tables)
