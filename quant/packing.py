"""Bit packing for GPTQ / AWQ int32 words, and the reference dequantization of both formats.

Every function here is plain torch on integer tensors so that it can serve as the oracle the fast
kernels are tested against. Layouts (see docs/quantization.md):

- GPTQ qweight int32 [in/pf, out]: field i of word r is input row pf*r + i (pf = 32 / bits).
  qzeros int32 [groups, out/pf]: packed along the output dim in the same field order.
- AWQ qweight int32 [in, out/8] and qzeros [groups, out/8]: packed along the output dim, with the
  8 fields of a word holding columns AWQ_PACK_ORDER (so unpacking needs AWQ_UNPACK_ORDER).
"""

from __future__ import annotations

import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
SUPPORTED_PACK_BITS = (2, 4, 8)


def pack_factor(bits: int) -> int:
    if bits not in SUPPORTED_PACK_BITS:
        raise ValueError(f"cannot pack {bits}-bit values into int32 words; supported: {SUPPORTED_PACK_BITS}")
    return 32 // bits


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> int32 [R * pf, C]; row pf*r + i is field i of row r (values in [0, 2**bits))."""
    assert packed.dtype == torch.int32 and packed.dim() == 2, (packed.dtype, packed.shape)
    pf = pack_factor(bits)
    fields = (packed.unsqueeze(1) >> _shifts(bits, packed.device).view(1, pf, 1)) & ((1 << bits) - 1)
    return fields.reshape(packed.shape[0] * pf, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, C * pf]; column pf*c + i is field i of column c."""
    assert packed.dtype == torch.int32 and packed.dim() == 2, (packed.dtype, packed.shape)
    pf = pack_factor(bits)
    fields = (packed.unsqueeze(2) >> _shifts(bits, packed.device).view(1, 1, pf)) & ((1 << bits) - 1)
    return fields.reshape(packed.shape[0], packed.shape[1] * pf)


def _pack_last(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n * pf] ints in [0, 2**bits) -> int32 [..., n], field i = element pf*j + i."""
    pf = pack_factor(bits)
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, pf) & ((1 << bits) - 1)
    words = (v << _shifts(bits, values.device).to(torch.int64)).sum(-1)
    # Wrap to the signed int32 the checkpoints store (bit pattern preserved).
    return (words - ((words >> 31) << 32)).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of unpack_rows: [R * pf, C] -> int32 [R, C]."""
    return _pack_last(values.t(), bits).t().contiguous()


def pack_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of unpack_cols: [R, C * pf] -> int32 [R, C]."""
    return _pack_last(values, bits)


def _awq_column_perm(n_cols: int, order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    base = torch.arange(0, n_cols, 8, device=device).view(-1, 1)
    return (base + torch.tensor(order, device=device).view(1, 8)).reshape(-1)


def unpack_awq(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """AWQ int32 [R, C] -> int32 [R, C * 8] in natural column order (undoes the interleave)."""
    if bits != 4:
        raise ValueError(f"AWQ packing is defined for 4-bit only, got {bits}")
    fields = unpack_cols(packed, bits)
    return fields.index_select(1, _awq_column_perm(fields.shape[1], AWQ_UNPACK_ORDER, packed.device))


def pack_awq(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Inverse of unpack_awq: natural-order [R, C * 8] -> interleaved int32 [R, C]."""
    if bits != 4:
        raise ValueError(f"AWQ packing is defined for 4-bit only, got {bits}")
    interleaved = values.index_select(1, _awq_column_perm(values.shape[1], AWQ_PACK_ORDER, values.device))
    return pack_cols(interleaved, bits)


def default_g_idx(in_features: int, group_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Group of each input row without act-order; group_size -1 means a single group."""
    g = in_features if group_size == -1 else group_size
    return torch.arange(in_features, dtype=torch.int32, device=device) // g


def gptq_zeros(qzeros: torch.Tensor, bits: int, zero_offset: int) -> torch.Tensor:
    """int32 [groups, out]: the true zero points. v1 checkpoints store z-1 (zero_offset=1), gptq_v2 z (0).

    The +1 wraps modulo 2**bits exactly as AutoGPTQ/GPTQModel's own dequantization does (a v1 zero of 0
    is stored as -1 = all ones)."""
    return (unpack_cols(qzeros, bits) + zero_offset) & ((1 << bits) - 1)


def gptq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    zero_offset: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference GPTQ dequantization -> W [out, in]: ((q - z)[g_idx] * s[g_idx]).T.

    The product is formed in float32 (exact for fp16 scales and <= 8-bit integers) and rounded once to
    `out_dtype` (default: the scales' dtype), which is what the tools' fp16 arithmetic yields."""
    q = unpack_rows(qweight, bits)  # [in, out]
    z = gptq_zeros(qzeros, bits, zero_offset)  # [groups, out]
    gi = g_idx.long()
    w = (q - z.index_select(0, gi)).to(torch.float32) * scales.index_select(0, gi).to(torch.float32)
    return w.t().contiguous().to(out_dtype or scales.dtype)


def awq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    group_size: int,
    bits: int = 4,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference AWQ GEMM dequantization -> W [out, in]: ((q - z)[i // g] * s[i // g]).T.

    `qzeros=None` is the zero_point=false (symmetric) variant, whose implicit zero is 2**(bits-1)."""
    q = unpack_awq(qweight, bits)  # [in, out]
    in_features = q.shape[0]
    gi = default_g_idx(in_features, group_size, q.device).long()
    if qzeros is None:
        z = torch.full_like(q, 1 << (bits - 1))
    else:
        z = unpack_awq(qzeros, bits).index_select(0, gi)
    w = (q - z).to(torch.float32) * scales.index_select(0, gi).to(torch.float32)
    return w.t().contiguous().to(out_dtype or scales.dtype)
