"""GGUF blocks to float32, whole tensors at a time, bit-exact with gguf.quants.dequantize.

gguf dequantizes 16 rows per numpy call (np.array_split into thousands of groups, each through hsplit, reshape and
several temporaries): ~1 s for the default model's Q4_1 and Q8_0 matrices and 1.6 s for Gemma 3's, paid by every
fp32 load. Here the types the shipped models use run over chunks of blocks sized to stay in cache, writing into
one output array. Each formula repeats gguf's own operations in the same order and in float32 (no fused
multiply-add, so every rounding is gguf's): tests/test_gguf_dequant.py checks the bits on the real files' blocks and
on random ones. Every other type goes to gguf.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

_T = GGMLQuantizationType
# Blocks per chunk: a chunk's temporaries (a few times 32-256 floats a block) stay within a core's L2.
_CHUNK_VALUES = 1 << 16


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 values of a tensor as GGUFReader hands it (quantized: uint8 [..., row_bytes]), as gguf would give
    them: a new array (F32: a view of `data`, as gguf's)."""
    fast = _BLOCK_FORMULAS.get(qtype)
    if fast is None:
        return gguf_dequantize(data, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    if data.shape[-1] % size:
        raise ValueError(f"{qtype.name} row of {data.shape[-1]} bytes is not a multiple of its {size}-byte block")
    blocks = np.ascontiguousarray(data).reshape(-1, size)
    out = np.empty((blocks.shape[0], block), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // block)
    for start in range(0, blocks.shape[0], step):
        fast(blocks[start:start + step], out[start:start + step])
    return out.reshape(*data.shape[:-1], data.shape[-1] // size * block)


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of each block, as float32 [n, 1]."""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Low nibbles then high nibbles of each row of `packed` [n, k] into `out` [n, 2k] (uint8): gguf's order."""
    k = packed.shape[1]
    np.bitwise_and(packed, 0x0F, out=out[:, :k])
    np.right_shift(packed, 4, out=out[:, k:])
    return out


def _q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # gguf: d * x, x int8 as float32
    np.multiply(_half(blocks, 0), blocks[:, 2:].view(np.int8), out=out, dtype=np.float32)


def _q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # gguf: d * (nibble - 8), the subtraction in int8
    q = _nibbles(blocks[:, 2:], np.empty((blocks.shape[0], 32), np.uint8)).view(np.int8)
    q -= np.int8(8)
    np.multiply(_half(blocks, 0), q, out=out, dtype=np.float32)


def _q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    # gguf: (d * nibble) + m; nibble * d is the same product (IEEE multiplication commutes), in place it is faster
    out[...] = _nibbles(blocks[:, 4:], np.empty((blocks.shape[0], 32), np.uint8))
    out *= _half(blocks, 0)
    out += _half(blocks, 2)


def _q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # gguf: d * ((nibble | fifth bit << 4) - 16), the subtraction in int8; bit i of the little-endian qh is value i's
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 6:], np.empty((n, 32), np.uint8))
    high = np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little")
    q |= high << np.uint8(4)
    q = q.view(np.int8)
    q -= np.int8(16)
    np.multiply(_half(blocks, 0), q, out=out, dtype=np.float32)


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of each Q4_K block's 12 scale bytes (gguf's get_scale_min), uint8 [n, 8]."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mins


def _q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # gguf: (d * scale) * nibble - (dmin * min), per 32 values; qs holds four 32-byte runs, low nibbles first
    n = blocks.shape[0]
    sc, mins = _q4_k_scales(blocks[:, 4:16])
    scale = (_half(blocks, 0) * sc.astype(np.float32))[:, :, None]
    offset = (_half(blocks, 2) * mins.astype(np.float32))[:, :, None]
    q = np.empty((n, 4, 2, 32), np.uint8)
    runs = blocks[:, 16:].reshape(n, 4, 32)
    np.bitwise_and(runs, 0x0F, out=q[:, :, 0])
    np.right_shift(runs, 4, out=q[:, :, 1])
    values = out.reshape(n, 8, 32)
    np.multiply(scale, q.reshape(n, 8, 32), out=values, dtype=np.float32)
    values -= offset


def _q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # gguf: (d * scale) * ((low nibble | two high bits << 4) - 32), per 16 values, the subtraction in int8
    n = blocks.shape[0]
    low = np.empty((n, 2, 2, 64), np.uint8)  # [half, nibble, 64]
    runs = blocks[:, :128].reshape(n, 2, 64)
    np.bitwise_and(runs, 0x0F, out=low[:, :, 0])
    np.right_shift(runs, 4, out=low[:, :, 1])
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = low.reshape(n, 8, 32) | ((qh & np.uint8(0x03)).reshape(n, 8, 32) << np.uint8(4))
    q = q.view(np.int8)
    q -= np.int8(32)
    scale = _half(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    np.multiply(scale[:, :, None], q.reshape(n, 16, 16), out=out.reshape(n, 16, 16), dtype=np.float32)


_BLOCK_FORMULAS: dict[GGMLQuantizationType, Callable[[np.ndarray, np.ndarray], None]] = {
    _T.Q8_0: _q8_0, _T.Q4_0: _q4_0, _T.Q4_1: _q4_1, _T.Q5_0: _q5_0, _T.Q4_K: _q4_k, _T.Q6_K: _q6_k,
}
