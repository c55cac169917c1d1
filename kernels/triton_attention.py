"""Triton PagedAttention: one kernel for prefill, chunked prefill and decode.

Grid: (query blocks over all sequences, KV heads). A program owns BLOCK_Q consecutive new tokens of one
sequence together with the NUM_QUERIES_PER_KV query heads that share its KV head (BLOCK_M rows = token x head),
so each K/V tile is read once per GQA group. It walks the sequence's block table one cache block per iteration
with an online softmax (exp2 domain); FP8 blocks are dequantized by their per-KV-head scale right after the load,
int8 blocks by each row's own scale (loaded beside the tile), so tl.dot only ever sees 16-bit (or fp32) operands. New tokens attend causally to each other and to the cached
context before them; with a sliding window W a row at position p sees only keys p - W < k <= p, and the walk starts
at the block of the program's first row's first visible key (earlier blocks may be freed: their table entries are
-1). Offsets that are multiplied by strides are int64: a 40 GB cache overflows int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.kv_cache import LayerKVCache
from pagedserve.kernels.attention import AttentionMetadata

_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30  # beyond any context: every earlier key visible, q_abs - window stays in int32
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    k_row_scale_ptr, v_row_scale_ptr,  # int8: fp16 [num_blocks, block_size, Hkv] views; unused otherwise
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale_log2,  # softmax scale * log2(e)
    num_seqs,
    window,  # sliding window; larger than any context when the layer has none
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_pos, stride_c_head, stride_bt_seq,
    stride_s_block, stride_s_pos, stride_s_head,
    NUM_QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr, IS_INT8: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    # Real GPUs need dot K >= 16 for 16-bit operands (>= 32 for 8-bit; never used: FP8 is dequantized first).
    # The interpreter accepts anything, so state it here.
    tl.static_assert(HEAD_DIM_PAD >= 16, "tl.dot needs K = head_dim >= 16")
    tl.static_assert(BLOCK_SIZE >= 16, "tl.dot needs K = block_size >= 16")
    tl.static_assert(BLOCK_M >= 16, "tl.dot needs M >= 16")
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Sequence i's query blocks are numbered from qsl[i] // BLOCK_Q + i (the +i leaves room for its partial block).
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_SIZE)
    q_pos = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # index among the new tokens
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_ok = (q_pos < q_len) & (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV)
    d_ok = offs_d < HEAD_DIM
    tok = (q_start + q_pos).to(tl.int64)
    q_off = tok[:, None] * stride_q_tok + head.to(tl.int64)[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(DOT_DTYPE)

    if IS_FP8:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    q_abs = context_len + q_pos  # absolute position of each row's token: it sees keys <= q_abs
    last_key = context_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len)
    num_tiles = tl.cdiv(last_key, BLOCK_SIZE)
    first_tile = tl.maximum(context_len + q_block_local * BLOCK_Q - window + 1, 0) // BLOCK_SIZE
    head_off = kv_head.to(tl.int64) * stride_c_head
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile in range(first_tile, num_tiles):
        block = tl.load(bt_row + tile).to(tl.int64)
        key_pos = tile * BLOCK_SIZE + offs_n
        key_ok = key_pos < seq_len
        base = block * stride_c_block + head_off
        # K is loaded transposed ([D, N]) so the dot needs no tl.trans.
        k_off = base + offs_n[None, :].to(tl.int64) * stride_c_pos + offs_d[:, None]
        v_off = base + offs_n[:, None].to(tl.int64) * stride_c_pos + offs_d[None, :]
        k = tl.load(k_cache_ptr + k_off, mask=d_ok[:, None] & key_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + v_off, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if IS_FP8:
            k = (k.to(tl.float32) * k_scale).to(q_ptr.dtype.element_ty)
            v = (v.to(tl.float32) * v_scale).to(q_ptr.dtype.element_ty)
        if IS_INT8:
            # Each key's row scale; int8 x fp16 is exact in fp32, rounded once to the compute dtype as on the
            # torch path. Masked keys read scale 0 (their stale slots may hold anything).
            s_off = block * stride_s_block + offs_n.to(tl.int64) * stride_s_pos + kv_head.to(tl.int64) * stride_s_head
            k_rs = tl.load(k_row_scale_ptr + s_off, mask=key_ok, other=0.0).to(tl.float32)
            v_rs = tl.load(v_row_scale_ptr + s_off, mask=key_ok, other=0.0).to(tl.float32)
            k = (k.to(tl.float32) * k_rs[None, :]).to(q_ptr.dtype.element_ty)
            v = (v.to(tl.float32) * v_rs[:, None]).to(q_ptr.dtype.element_ty)
        k = k.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
        v = v.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale_log2
        visible = (key_pos[None, :] <= q_abs[:, None]) & (key_pos[None, :] > q_abs[:, None] - window) & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        # With a window, a later row may see no key of the first tiles yet: m_new = -inf. Subtracting 0 instead
        # keeps its p and alpha 0 rather than NaN (-inf - -inf).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q_ptr.dtype.element_ty).to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # padding rows (never stored) may see no key in a window
    o_off = tok[:, None] * stride_o_tok + head.to(tl.int64)[:, None] * stride_o_head + offs_d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _dot_dtype(compute: torch.dtype) -> tl.dtype:
    """The interpreter's tl.dot multiplies bf16 bit patterns as integers; upcasting the (already bf16-rounded)
    operands to fp32 there gives the same products a GPU's bf16 dot accumulates in fp32."""
    if compute == torch.bfloat16 and INTERPRETED:
        return tl.float32
    return _TL_DTYPES[compute]


def _block_m(max_query_len: int, queries_per_kv: int) -> int:
    """Rows per program: 16 (the smallest dot M) when decode-like, 64 when there are prompt chunks to tile."""
    rows = 16 if max_query_len * queries_per_kv <= 16 else 64
    return max(rows, triton.next_power_of_2(queries_per_kv))


# K and V tiles of one cache block are what the software pipeline multi-buffers in shared memory: three stages of a
# 128-token block at head_dim 256 need 294 KiB, over an H100's 227 KiB. This budget leaves room for the query tile
# and fits the 164 KiB of an A100 as well.
_PIPELINE_SHARED_BYTES = 128 * 1024


def _num_stages(block_size: int, head_dim_pad: int, element_size: int) -> int:
    tile_bytes = 2 * block_size * head_dim_pad * element_size
    return max(1, min(3, _PIPELINE_SHARED_BYTES // tile_bytes))


def check_supported(query: torch.Tensor, cache: LayerKVCache) -> None:
    """Shapes the kernel cannot take raise here, before launch, with the reason."""
    block_size, head_dim = cache.k.shape[1], cache.k.shape[3]
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"triton attention needs a power-of-two block_size >= 16, got {block_size}")
    if head_dim < 16:
        raise ValueError(f"triton attention needs head_dim >= 16, got {head_dim}")
    if query.dtype not in _TL_DTYPES:
        raise ValueError(f"triton attention computes in fp16/bf16/fp32, got query dtype {query.dtype}")


def triton_paged_attention(
    query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float, window: int | None = None
) -> torch.Tensor:
    """query [T, H, D] -> output [T, H, D]; same contract as paged_attention.paged_attention."""
    check_supported(query, cache)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = cache.k.shape
    assert query.stride(2) == 1 and cache.k.stride(3) == 1, "last dims must be contiguous"
    assert cache.k.stride() == cache.v.stride(), "K and V caches must share a layout"
    assert meta.block_tables.stride(1) == 1
    queries_per_kv = num_heads // num_kv_heads
    block_m = _block_m(meta.max_query_len, queries_per_kv)
    block_q = block_m // queries_per_kv
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty_like(query)
    grid = (num_tokens // block_q + meta.num_seqs, num_kv_heads)
    is_int8 = cache.dtype.has_row_scales
    k_rows, v_rows = (cache.k_row_scale, cache.v_row_scale) if is_int8 else (cache.k_scale, cache.v_scale)
    _paged_attention_kernel[grid](
        out, query, cache.k, cache.v, cache.k_scale, cache.v_scale, k_rows, v_rows,
        meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale * _LOG2E, meta.num_seqs, _NO_WINDOW if window is None else min(window, _NO_WINDOW),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2), meta.block_tables.stride(0),
        *(cache.k_row_scale.stride() if is_int8 else (0, 0, 0)),
        NUM_QUERIES_PER_KV=queries_per_kv, BLOCK_M=block_m, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        IS_FP8=cache.dtype.is_fp8, IS_INT8=is_int8, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_DTYPE=_dot_dtype(query.dtype),
        num_stages=_num_stages(block_size, head_dim_pad, query.element_size()),
    )
    return out


# Triton builds every @triton.jit function under its interpreter when TRITON_INTERPRET=1 was set at import.
INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)
