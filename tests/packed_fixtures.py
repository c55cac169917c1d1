"""Random packed weights and the bounds a packed product must stay within (kernels/cpu/packed_linear.c and the
interleaved rows of kernels/cpu/packed_grouped.c), shared by the kernel tests and the GGUF layer tests.

Bounds: the fp32 product (the default) is x @ W^T within fp32 summation error: 1e-5 of |x| @ |W|^T, computed in
float64. The int8 variant rounds activations per 32 values (x ~ a q, |x - a q| <= a / 2), so it is checked twice:
against the same rounding emulated in numpy, x_q @ W^T, within fp32 summation error (1e-4 of |x_q| @ |W|^T); and
against the exact x @ W^T within the rounding's own bound, sum_i |W_i| a_i / 2 (+ that summation error).
The interleaved-rows kernel is exact in fp32 up to summation order in its AVX-512 fp32 and portable builds; its
AVX512-VNNI, AVX-VNNI and AVX2 builds round x to int16 per 32 values (a = max|x| / 32767) but keep exact fp32 block
sums for the offset term (kernels/cpu/act_q16.h): |y - x W^T| <= sum_k (a_k / 2) |d u_k| (+ the fp32 bound),
d u = w - m per block.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K, quantize

from gguf_fixtures import random_k_blocks
from pagedserve.kernels.cpu import packed as cpu_packed


def blocks_for(qtype: str, out: int, inn: int, rng: np.random.Generator) -> np.ndarray:
    """Random weights in `qtype`: gguf's quantizer where it has one, random K blocks (finite scales) otherwise."""
    if qtype.endswith("_K"):
        return random_k_blocks((out, inn), T[qtype], rng, scale=2e-3)
    return quantize(rng.standard_normal((out, inn)).astype(np.float32), T[qtype])


def quantized_activations(x: np.ndarray, top: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's int8 (top 127; int16: 32767) rounding of x [rows, in] emulated in float32: (a q as float64, a
    per value)."""
    runs = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(runs).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(top) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(runs * inv)
    scale = (amax / np.float32(top)).astype(np.float32)
    return (q * scale).astype(np.float64).reshape(x.shape), np.broadcast_to(scale, runs.shape).reshape(x.shape)


def check_product(matrix: cpu_packed.PackedMatrix, weights: np.ndarray, x: torch.Tensor) -> None:
    """Both variants of matrix's product: fp32 activations (x @ W^T within fp32 summation error) and int8 ones."""
    w = weights.astype(np.float64)
    xn = x.numpy()
    exact = np.abs(xn).astype(np.float64) @ np.abs(w).T
    y = matrix.matmul(x).numpy().astype(np.float64)
    np.testing.assert_array_less(np.abs(y - xn.astype(np.float64) @ w.T), 1e-5 * exact + 1e-5)
    rounded = cpu_packed.PackedMatrix(matrix.qtype, matrix.blocks, matrix.in_features, lib=matrix.lib,
                                      int8_max_rows=1 << 30)
    y = rounded.matmul(x).numpy().astype(np.float64)
    xq, scale = quantized_activations(xn)
    summation = 1e-4 * (np.abs(xq) @ np.abs(w).T) + 1e-5
    np.testing.assert_array_less(np.abs(y - xq @ w.T), summation)
    rounding = (scale / 2) @ np.abs(w).T
    np.testing.assert_array_less(np.abs(y - xn.astype(np.float64) @ w.T), rounding * 1.001 + summation)


def run_offsets(qtype: str, stored: np.ndarray, rows: int) -> np.ndarray:
    """Each 32-value run's offset m (w = d u + m) of `stored` [rows, bytes], as the int16 kernels split w: -8 d
    (Q4_0), the stored m (Q4_1), -16 d (Q5_0), -dmin mn (Q4_K, Q5_K: gguf's own scale decoding), 0 for the signed
    codes (Q8_0, Q6_K's u - 32)."""
    _, per, size = cpu_packed.FORMATS[qtype]
    raw = stored.view(np.uint8).reshape(rows, -1, size)
    half = lambda at: raw[:, :, at:at + 2].copy().view(np.float16)[..., 0].astype(np.float64)  # noqa: E731
    if qtype in ("Q4_K", "Q5_K"):
        _, mins = Q4_K.get_scale_min(raw[:, :, 4:16].reshape(-1, 12))
        return -(half(2)[..., None] * mins.reshape(rows, -1, 8)).reshape(rows, -1)
    if qtype in ("Q8_0", "Q6_K"):
        return np.zeros((rows, raw.shape[1] * per // 32))
    return {"Q4_0": -8 * half(0), "Q4_1": half(2), "Q5_0": -16 * half(0)}[qtype]


def grouped_bound(matrix: cpu_packed.PackedMatrix, stored: np.ndarray, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """What the interleaved layout's product may differ from x @ W^T by, per output [rows, out]: fp32 summation
    error, and in the int16 builds (INT16_GROUPED_ISAS) the rounding of x, sum_k (a_k / 2) |d u_k| (with 0.1% for a's own
    rounding), d u = w - m per 32-value run (run_offsets)."""
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-5
    if cpu_packed.grouped_isa(matrix.lib, matrix.qtype) not in cpu_packed.INT16_GROUPED_ISAS:
        return bound
    code_terms = np.abs(w - np.repeat(run_offsets(matrix.qtype, stored, w.shape[0]), 32, axis=1))
    _, scale = quantized_activations(x, 32767)
    return bound + 1.001 * ((scale.astype(np.float64) / 2) @ code_terms.T)
