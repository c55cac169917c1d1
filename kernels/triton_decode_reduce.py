"""The decode kernel's reduce: with more than one partition, each (sequence, query head)'s partial outputs, maxima
and sums (kernels/triton_decode_attention.py's workspace) merged into the output by a running maximum."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def reduce_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, seq_lens_ptr, query_start_loc_ptr, window, num_heads, num_partitions,
    stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TILE_N: tl.constexpr,
):
    """One (sequence, query head): the partitions the decode kernel filled, merged by a running maximum."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    # A padded batch's dummy rows may carry no context (seq_len 0): the decode kernel skipped them, so does this.
    if (tl.load(query_start_loc_ptr + seq + 1) > q_row) & (seq_len > 0):
        part_tokens = tl.cdiv(tl.cdiv(seq_len, num_partitions), TILE_N) * TILE_N
        # The partitions the decode kernel ran: they start before the end and end after the first visible key.
        first_part = tl.maximum(seq_len - window, 0) // part_tokens
        last_part = tl.cdiv(seq_len, part_tokens)
        base = (seq.to(tl.int64) * num_heads + head) * num_partitions
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
        total = tl.zeros([], dtype=tl.float32)
        m_run = tl.full([], float("-inf"), dtype=tl.float32)
        for p in range(first_part, last_part):  # every partition that ran has a finite maximum
            m_p = tl.load(part_ml_ptr + 2 * (base + p))
            m_new = tl.maximum(m_run, m_p)
            keep = tl.exp2(m_run - m_new)
            weight = tl.exp2(m_p - m_new)
            total = total * keep + weight * tl.load(part_ml_ptr + 2 * (base + p) + 1)
            acc = acc * keep + weight * tl.load(part_acc_ptr + (base + p) * HEAD_DIM_PAD + offs_d)
            m_run = m_new
        o_off = q_row.to(tl.int64) * stride_o_tok + head.to(tl.int64) * stride_o_head + offs_d
        tl.store(out_ptr + o_off, (acc / total).to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
