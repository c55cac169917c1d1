"""Triton decode attention: one new token per sequence, the context split into partitions (flash-decoding).

Grid: (sequences, KV heads, partitions). A program owns the NUM_QUERIES_PER_KV query heads of one KV head (GQA: each
K/V byte is read once per group) and one partition of its sequence's context, which it walks TILE_N tokens at a
time (16 KiB of K + V once converted): a tile's rows are gathered through the block table, so it may span several
cache blocks, and the next tile's loads are issued before this tile's math. The partition count is a launch
constant (`decode_partitions`: from the batch size, the KV heads and the block table's width, never from per-step
device data, so a captured CUDA graph replays one grid for every step); each sequence cuts its own context into
that many partitions, rounded up to whole tiles, and programs past its end exit at once. With more than one
partition, each program writes its unnormalized fp32 output, running max and sum to a workspace and
`reduce_kernel` (kernels/triton_decode_reduce.py) merges them; with one it writes the output itself.

Narrow caches are loaded as they are stored and converted in registers (FP8 and int8 convert exactly to fp16/bf16;
the launch option `word_tiles` loads them as 32-bit words widened before the dot: kernels/triton_decode_words.py);
their scales are folded in rather than applied per element: the per-KV-head FP8 scales into the score scale and
the final output, int8's per-token row scales into the score columns (K) and the probabilities (V). The option
`keys_major` computes a tile with the keys along the MMA's M (kernels/triton_decode_keys_major.py).
A sliding window W shows the query at position L - 1 the keys L - W <= k < L; tiles start at the tile of the first
visible key and masked loads never touch the blocks before it (their table entries may be -1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.kernels.kv_cache import LayerKVCache
from pagedserve.kernels.triton_attention import (
    _LOG2E, _NO_WINDOW, INTERPRETED, _dot_dtype, _num_stages, check_supported,
)
from pagedserve.kernels.triton_decode_keys_major import attend_tile_keys_major
from pagedserve.kernels.triton_decode_reduce import reduce_kernel
from pagedserve.kernels.triton_decode_words import WORD_FORMATS, check_word_tiles, load_words

# The split rule (docs/gpu.md): enough programs to fill an H100/H200 several times over (132 SMs, two or three
# resident programs each), partitions of at least MIN_PARTITION_TOKENS so each program's fixed cost (its query
# load and partial store) stays small against its K/V reads, and at most MAX_PARTITIONS (the reduce loops over them).
TARGET_PROGRAMS = 2048
MIN_PARTITION_TOKENS = 256
MAX_PARTITIONS = 64
# K + V bytes of one tile in the compute dtype: 64 tokens at head_dim 128, no prefetch of the next tile; FP8 caches
# take twice the tokens (decode_tile); 4 warps but for int8 (decode_warps). Chosen on an H200
# (benchmarks/results/gpu-check-h200-2026-11-28.json, batch 64 x 4k, Llama-3-8B-shaped layer): 0.82 of copy bandwidth
# for fp16 against 0.56 for 32-token tiles with the prefetch and 0.70 for 16-token ones with 4 warps; FP8 0.41
# against 0.29, int8 0.33 against 0.22; then 4 warps and FP8's 128 tokens (gpu-check-h200-2026-11-30*.json). The
# prefetch is kept as an option (it needs the smaller tile to fit 128 registers a thread).
_TILE_BYTES = 32 * 1024
_MAX_REGISTERS = 128


@triton.jit
def _load_tile(
    k_cache_ptr, v_cache_ptr, k_row_scale_ptr, v_row_scale_ptr, bt_row, tile_start, end, first_key, head_off, kv_head,
    stride_c_block, stride_c_pos, stride_s_block, stride_s_pos, stride_s_head, offs_n, offs_d,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_INT8: tl.constexpr,
    WORDS: tl.constexpr, WORDS_PTX: tl.constexpr,
):
    """Keys tile_start + offs_n: K and V rows [TILE_N, HEAD_DIM_PAD] gathered through the block table (as stored, or
    for WORDS ("e4m3", "e5m2", "int8") loaded as words and widened to fp16: kernels/triton_decode_words.py), which
    keys are visible, and int8's row scales (0 for masked keys: stale slots may hold anything, NaN scales included)."""
    key_pos = tile_start + offs_n
    key_ok = (key_pos < end) & (key_pos >= first_key)
    block = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    slot = (key_pos % BLOCK_SIZE).to(tl.int64)
    rows = block * stride_c_block + slot * stride_c_pos + head_off
    if WORDS != "":
        k, v = load_words(k_cache_ptr, v_cache_ptr, rows, key_ok, HEAD_DIM, HEAD_DIM_PAD, WORDS, WORDS_PTX)
    else:
        if HEAD_DIM == HEAD_DIM_PAD:  # a mask constant along head_dim keeps the loads vectorized
            kv_mask = key_ok[:, None]
        else:
            kv_mask = key_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if IS_INT8:
        s_off = block * stride_s_block + slot * stride_s_pos + kv_head.to(tl.int64) * stride_s_head
        k_rs = tl.load(k_row_scale_ptr + s_off, mask=key_ok, other=0.0).to(tl.float32)
        v_rs = tl.load(v_row_scale_ptr + s_off, mask=key_ok, other=0.0).to(tl.float32)
    else:
        k_rs = tl.zeros(offs_n.shape, dtype=tl.float32)  # unused
        v_rs = k_rs
    return k, v, key_ok, k_rs, v_rs


@triton.jit
def _attend_tile(q, k, v, key_ok, k_rs, v_rs, m_i, l_i, acc, score_scale,
                 compute: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, IS_INT8: tl.constexpr):
    """One online-softmax step (exp2 domain). Narrow K/V convert exactly to the compute dtype; int8's row scales
    multiply the score columns (K) and the probabilities (V) instead of every element."""
    s = tl.dot(q, tl.trans(k.to(compute).to(DOT_DTYPE)), input_precision=DOT_PRECISION) * score_scale
    if IS_INT8:
        s = s * k_rs[None, :]
    s = tl.where(key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds a visible key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IS_INT8:
        p = p * v_rs[None, :]
    pv = tl.dot(p.to(compute).to(DOT_DTYPE), v.to(compute).to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _decode_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    k_row_scale_ptr, v_row_scale_ptr,  # int8: fp16 [num_blocks, block_size, Hkv] views; unused otherwise
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale_log2, window, num_heads, num_partitions,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_pos, stride_c_head, stride_bt_seq,
    stride_s_block, stride_s_pos, stride_s_head,
    NUM_QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
    IS_FP8: tl.constexpr, IS_INT8: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
    WORDS: tl.constexpr, WORDS_PTX: tl.constexpr, KEYS_MAJOR: tl.constexpr,
):
    tl.static_assert(HEAD_DIM_PAD >= 16, "tl.dot needs K = head_dim >= 16")
    tl.static_assert(TILE_N >= 16, "tl.dot needs N = tile >= 16")
    tl.static_assert(BLOCK_M >= (8 if KEYS_MAJOR else 16), "the query group is padded to 16 (keys_major: 8)")
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    q_row = tl.load(query_start_loc_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    part_tokens = tl.cdiv(tl.cdiv(seq_len, num_partitions), TILE_N) * TILE_N
    start = part * part_tokens
    end = tl.minimum(start + part_tokens, seq_len)
    first_key = tl.maximum(seq_len - window, 0)
    if (tl.load(query_start_loc_ptr + seq + 1) > q_row) & (start < end) & (first_key < end):
        compute = q_ptr.dtype.element_ty
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        offs_n = tl.arange(0, TILE_N)
        head = kv_head * NUM_QUERIES_PER_KV + offs_m
        row_ok = offs_m < NUM_QUERIES_PER_KV
        d_ok = offs_d < HEAD_DIM
        q_off = q_row.to(tl.int64) * stride_q_tok + head.to(tl.int64)[:, None] * stride_q_head + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
        score_scale = qk_scale_log2
        if IS_FP8:
            score_scale = score_scale * tl.load(k_scale_ptr + kv_head)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if KEYS_MAJOR:  # kernels/triton_decode_keys_major.py: q and the accumulator transposed
            q = tl.trans(q)
            acc = tl.zeros([HEAD_DIM_PAD, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        head_off = kv_head.to(tl.int64) * stride_c_head
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
        lo = tl.maximum(start, first_key // TILE_N * TILE_N)
        if PREFETCH:
            k, v, key_ok, k_rs, v_rs = _load_tile(
                k_cache_ptr, v_cache_ptr, k_row_scale_ptr, v_row_scale_ptr, bt_row, lo, end, first_key, head_off,
                kv_head, stride_c_block, stride_c_pos, stride_s_block, stride_s_pos, stride_s_head,
                offs_n, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, IS_INT8, WORDS, WORDS_PTX)
        for tile_start in range(lo, end, TILE_N):
            if PREFETCH:
                # The next tile's loads are issued before this tile's math: one tile stays in flight while the
                # program computes (Triton's pipeliner does not take these gathered loads). Past `end` all masked.
                nk, nv, n_ok, nk_rs, nv_rs = _load_tile(
                    k_cache_ptr, v_cache_ptr, k_row_scale_ptr, v_row_scale_ptr, bt_row, tile_start + TILE_N, end,
                    first_key, head_off, kv_head, stride_c_block, stride_c_pos, stride_s_block, stride_s_pos,
                    stride_s_head, offs_n, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, IS_INT8, WORDS, WORDS_PTX)
            else:
                k, v, key_ok, k_rs, v_rs = _load_tile(
                    k_cache_ptr, v_cache_ptr, k_row_scale_ptr, v_row_scale_ptr, bt_row, tile_start, end, first_key,
                    head_off, kv_head, stride_c_block, stride_c_pos, stride_s_block, stride_s_pos, stride_s_head,
                    offs_n, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, IS_INT8, WORDS, WORDS_PTX)
            if KEYS_MAJOR:
                m_i, l_i, acc = attend_tile_keys_major(q, k, v, key_ok, k_rs, v_rs, m_i, l_i, acc, score_scale,
                                                       compute, DOT_PRECISION, DOT_DTYPE, IS_INT8)
            else:
                m_i, l_i, acc = _attend_tile(q, k, v, key_ok, k_rs, v_rs, m_i, l_i, acc, score_scale,
                                             compute, DOT_PRECISION, DOT_DTYPE, IS_INT8)
            if PREFETCH:
                k, v, key_ok, k_rs, v_rs = nk, nv, n_ok, nk_rs, nv_rs
        if KEYS_MAJOR:
            acc = tl.trans(acc)
        if IS_FP8:
            acc = acc * tl.load(v_scale_ptr + kv_head)
        if not SPLIT:
            o_off = q_row.to(tl.int64) * stride_o_tok + head.to(tl.int64)[:, None] * stride_o_head + offs_d[None, :]
            tl.store(out_ptr + o_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])
        else:
            slot = (seq.to(tl.int64) * num_heads + head) * num_partitions + part  # [BLOCK_M]
            tl.store(part_acc_ptr + slot[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + 2 * slot, m_i, mask=row_ok)
            tl.store(part_ml_ptr + 2 * slot + 1, l_i, mask=row_ok)


def decode_partitions(num_seqs: int, num_kv_heads: int, table_tokens: int) -> int:
    """How many partitions each sequence's context is cut into (a power of two; 1 = a single pass, no reduce).

    Only static values: the batch size, the KV heads and the block table's width in tokens (the longest context a
    sequence of this step can have; a graph-captured step's table is as wide as its captured buffer)."""
    wanted = triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads)))
    allowed = 1 << (max(1, table_tokens // MIN_PARTITION_TOKENS).bit_length() - 1)  # largest power of two <= it
    return min(wanted, allowed, MAX_PARTITIONS)


def decode_tile(head_dim_pad: int, compute_itemsize: int, fp8_cache: bool = False) -> int:
    """Tokens per iteration: _TILE_BYTES of K + V once converted (FP8 caches: as stored, twice the tokens), a power of
    two in [16 (tl.dot's minimum), 128]; a tile may cover several cache blocks or part of one. On an H200 at head
    dim 128 FP8's 128-token tile read 0.455 of copy bandwidth against 0.41 for 64 (8 warps; batch 64 x 4k and
    16 x 16k); int8 read 0.33 either way and keeps 64 (fewer spills)."""
    tile = _TILE_BYTES // (2 * head_dim_pad * compute_itemsize) * (2 if fp8_cache else 1)
    return max(16, min(128, triton.next_power_of_2(tile)))


def decode_warps(tile_n: int, head_dim_pad: int, cache_itemsize: int = 2, fp8_cache: bool = False) -> int:
    """4 warps for 16-bit caches and FP8: fp16 0.96 of copy bandwidth against 0.83 with 8 (64-token tiles), FP8
    0.54 against 0.46 (128-token tiles; H200, batch 64 x 4k and 16 x 16k, gpu-check-h200-2026-11-30.json). int8
    keeps 8: 0.33 against 0.30 with 4."""
    return 8 if cache_itemsize == 1 and not fp8_cache else 4


def is_decode_step(meta: AttentionMetadata) -> bool:
    return meta.max_query_len == 1


def triton_decode_attention(
    query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float, window: int | None = None,
    *, num_partitions: int | None = None, tile_n: int | None = None, num_warps: int | None = None,
    prefetch: bool = False, num_stages: int | None = None, word_tiles: bool = False, keys_major: bool = False,
) -> torch.Tensor:
    """query [T, H, D] of a decode step (at most one token per sequence) -> [T, H, D]. num_partitions, tile_n,
    num_warps, prefetch and num_stages override the rules above (benchmarks measure the alternatives); word_tiles
    loads an 8-bit cache's tiles as 32-bit words widened to fp16 before tl.dot (kernels/triton_decode_words.py);
    keys_major computes the tile with keys along the MMA's M (kernels/triton_decode_keys_major.py)."""
    check_supported(query, cache)
    if word_tiles:
        check_word_tiles(cache)
    words = WORD_FORMATS[cache.dtype] if word_tiles else ""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = cache.k.shape
    assert query.stride(2) == 1 and cache.k.stride(3) == 1, "last dims must be contiguous"
    assert cache.k.stride() == cache.v.stride(), "K and V caches must share a layout"
    assert meta.block_tables.stride(1) == 1
    queries_per_kv = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    itemsize = cache.k.element_size()
    tile = tile_n or decode_tile(head_dim_pad, query.element_size(), cache.dtype.is_fp8)
    assert tile >= 16 and tile & (tile - 1) == 0, "a tile is a power of two of at least 16 tokens"
    warps = num_warps or decode_warps(tile, head_dim_pad, itemsize, cache.dtype.is_fp8)
    parts = num_partitions or decode_partitions(meta.num_seqs, num_kv_heads, meta.block_tables.shape[1] * block_size)
    out = torch.empty_like(query)
    if parts > 1:
        rows = meta.num_seqs * num_heads * parts
        part_acc = torch.empty(rows, head_dim_pad, device=query.device, dtype=torch.float32)
        part_ml = torch.empty(rows, 2, device=query.device, dtype=torch.float32)
    else:
        part_acc = part_ml = out  # never touched: the kernel writes the output itself
    is_int8 = cache.dtype.has_row_scales
    k_rows, v_rows = (cache.k_row_scale, cache.v_row_scale) if is_int8 else (cache.k_scale, cache.v_scale)
    window_arg = _NO_WINDOW if window is None else min(window, _NO_WINDOW)
    _decode_kernel[(meta.num_seqs, num_kv_heads, parts)](
        out, part_acc, part_ml, query, cache.k, cache.v, cache.k_scale, cache.v_scale, k_rows, v_rows,
        meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale * _LOG2E, window_arg, num_heads, parts,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2), meta.block_tables.stride(0),
        *(cache.k_row_scale.stride() if is_int8 else (0, 0, 0)),
        NUM_QUERIES_PER_KV=queries_per_kv, BLOCK_M=max(8 if keys_major else 16, triton.next_power_of_2(queries_per_kv)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, TILE_N=tile, SPLIT=parts > 1,
        PREFETCH=prefetch,
        IS_FP8=cache.dtype.is_fp8, IS_INT8=is_int8, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_DTYPE=_dot_dtype(query.dtype), WORDS=words, WORDS_PTX=not INTERPRETED, KEYS_MAJOR=keys_major,
        num_warps=warps, num_stages=num_stages or _num_stages(tile, head_dim_pad, itemsize),
        **({"maxnreg": _MAX_REGISTERS} if warps == 8 else {}),
    )
    if parts > 1:
        reduce_kernel[(meta.num_seqs, num_heads)](
            out, part_acc, part_ml, meta.seq_lens, meta.query_start_loc, window_arg, num_heads, parts,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, TILE_N=tile,
        )
    return out
