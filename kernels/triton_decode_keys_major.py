"""The decode kernel's tile step with keys along the MMA's M dimension (`keys_major`): S^T = K Q^T, O^T += V^T P^T.

The default step computes S = Q K^T with the query group as M, padded to tl.dot's 16 rows: at 4 query heads a KV
head three quarters of every score, exponential and rescale are padding. Here M is the tile's tokens and the group is
N, padded to 8 only: on sm_90 Triton then issues Hopper's warpgroup MMA (wgmma, N = 8), K in registers as its A
operand and P^T from shared memory. The softmax runs down the columns (axis 0) and the accumulator is O^T
[HEAD_DIM, group]; the math is the default step's, summed in another order (docs/gpu.md has the sm_90 counts).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile_keys_major(q_t, k, v, key_ok, k_rs, v_rs, m_i, l_i, acc_t, score_scale, compute: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, IS_INT8: tl.constexpr):
    """One online-softmax step (exp2 domain) with q_t [HEAD_DIM, group] and acc_t [HEAD_DIM, group]; as the default
    step, int8's row scales multiply the score rows (K) and the probabilities (V)."""
    s = tl.dot(k.to(compute).to(DOT_DTYPE), q_t, input_precision=DOT_PRECISION) * score_scale  # [TILE_N, group]
    if IS_INT8:
        s = s * k_rs[:, None]
    s = tl.where(key_ok[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: every tile holds a visible key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    if IS_INT8:
        p = p * v_rs[:, None]
    acc_t = tl.dot(tl.trans(v.to(compute).to(DOT_DTYPE)), p.to(compute).to(DOT_DTYPE), acc_t * alpha[None, :],
                   input_precision=DOT_PRECISION)
    return m_new, l_i, acc_t
