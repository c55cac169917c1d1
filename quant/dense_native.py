"""Dense bf16/fp16/fp32 weights as a native linear (kernels/cpu/dense_linear.c) for the native small-batch step.

The kernel reads W [out, in] row-major, or bf16 rows interleaved in groups of 16 (quant/dense_layout.py, read by
kernels/cpu/dense_grouped.c). A oneDNN copy is blocked and opaque, so the layer's weight is turned back into a
plain tensor (`plain_weight`) that both the native step and the torch path then read (quant/unquantized.py): one
copy of the weights. A tied LM head's plain weight is the embedding's own tensor (`QuantLinear.weight_shared`).
"""

from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels.cpu.native import COMPUTE_DTYPES, dtype_code, load_library
from pagedserve.kernels.cpu.structs import DenseLinearState
from pagedserve.quant.dense_layout import row_group
from pagedserve.quant.native_linear import DEFAULT_NATIVE_MAX_BATCH, NativeLinear


def plain_weight(weight: torch.Tensor) -> torch.Tensor:
    """A dense row-major copy of a weight (oneDNN's packed tensors included)."""
    return (weight.to_dense() if weight.layout == torch._mkldnn else weight).contiguous()


def dense_native_linear(weight: torch.Tensor, bias: torch.Tensor | None, portable: bool = False,
                        lib: ctypes.CDLL | None = None, x_fp32: bool = False,
                        native_max_batch: int = DEFAULT_NATIVE_MAX_BATCH) -> NativeLinear:
    """weight [out, in] (bf16, fp16 or fp32, CPU, contiguous; row-major or grouped: `row_group`), bias [out] or None
    -> the kernel and its state. portable: the code a host without AVX-512 runs, whatever this one has (for tests;
    row-major weights only). lib: the build to run (tests pass one compiled with CPU features switched off).
    x_fp32: 16-bit weights of an fp32-compute model: activations are not rounded to the weight's dtype, the
    weights are widened (exactly) in registers, so the products are the fp32 model's."""
    if weight.device.type != "cpu" or weight.dtype not in COMPUTE_DTYPES or weight.dim() != 2:
        raise ValueError(f"dense native linear: weight must be a 2-D CPU tensor in {COMPUTE_DTYPES}, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    weight = weight.contiguous()
    if bias is not None:
        if bias.shape != (weight.shape[0],) or bias.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dense native linear: bias must be [{weight.shape[0]}] in {COMPUTE_DTYPES}")
        bias = bias.contiguous()
    if portable and row_group(weight):
        raise ValueError("dense native linear: the portable kernel reads row-major weights only, not grouped ones")
    out_features, in_features = weight.shape
    state = DenseLinearState(
        weight.data_ptr(), None if bias is None else bias.data_ptr(), dtype_code(weight.dtype),
        dtype_code(bias.dtype) if bias is not None else 0, in_features, out_features, row_group(weight), int(x_fp32),
    )
    lib = lib or load_library()
    fn = lib.pagedserve_dense_linear_portable if portable else lib.pagedserve_dense_linear
    return NativeLinear(
        fn=ctypes.cast(fn, ctypes.c_void_p).value, state=ctypes.addressof(state),
        in_features=in_features, out_features=out_features, keepalive=(state, weight, bias),
        native_max_batch=native_max_batch,
    )


def call_native_linear(linear: NativeLinear, x: torch.Tensor) -> torch.Tensor:
    """Runs a NativeLinear from Python: x [rows, in] fp32 -> y [rows, out] fp32 (tests and measurements)."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == linear.in_features
    x = x.contiguous()
    y = torch.empty(x.shape[0], linear.out_features, dtype=torch.float32)
    fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)(linear.fn)
    status = fn(linear.state, x.data_ptr(), x.shape[0], y.data_ptr())
    if status != 0:
        raise RuntimeError(f"native linear failed with status {status}")
    return y


def dense_gemm(linear: NativeLinear, x: torch.Tensor, lib: ctypes.CDLL | None = None,
               allow_amx: bool = True) -> torch.Tensor:
    """x [rows, in] (fp32 or bf16, CPU) @ W^T + bias for a `dense_native_linear` over a grouped bf16 weight, at any
    number of rows (kernels/cpu/dense_gemm.c), in x's dtype. lib: the build `linear` was made with (default: the
    library's). allow_amx False: the AVX512-BF16 or fp32 code even where AMX is granted (tests)."""
    x, y = _operands(linear, x, (torch.float32, torch.bfloat16), "dense gemm", "fp32 or bf16")
    if x.shape[0] == 0:
        return y
    code = dtype_code(x.dtype)
    status = (lib or load_library()).pagedserve_dense_gemm(linear.state, x.data_ptr(), code, x.shape[0],
                                                           y.data_ptr(), code, int(allow_amx))
    _check_status(status, "dense gemm", "a grouped bf16 weight")
    return y


def gemm_isa(x_fp32: bool = False, lib: ctypes.CDLL | None = None, allow_amx: bool = True) -> str:
    """The code `dense_gemm` runs here: "amx" (tiles granted), "avx512_bf16", "avx512", "avx2" (fp32 compute, or
    bf16 compute without 16-bit arithmetic) or "portable" (no grouped layout in this build)."""
    return (lib or load_library()).pagedserve_dense_gemm_isa(int(x_fp32), int(allow_amx)).decode()


def rows_gemm_routed() -> bool:
    """Whether this build's `dense_rows_gemm` takes fp32 calls over plain fp32 or grouped bf16 weights
    (quant/unquantized.py): an AVX2 build without AVX-512, where it was measured against torch's sgemm and the
    grouped GEMM (docs/quantization.md). AVX-512 builds compile and test it but keep those, unmeasured there."""
    from pagedserve.kernels.cpu.native import available
    from pagedserve.quant.dense_layout import grouped_isa

    return available() and grouped_isa() == "avx2"


def dense_rows_gemm(linear: NativeLinear, x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] fp32 (CPU) @ W^T + bias for a `dense_native_linear` over a row-major fp32 weight, or over a
    grouped bf16 one made with x_fp32, at any number of rows (kernels/cpu/dense_rows.c): each output one FMA chain
    over the inputs in order, whatever `rows` (a grouped bf16 weight: the bits of its fp32 widening's).
    lib: the build `linear` was made with (default: the library's)."""
    x, y = _operands(linear, x, (torch.float32,), "dense rows gemm", "fp32")
    if x.shape[0] == 0:
        return y
    status = (lib or load_library()).pagedserve_dense_rows_gemm(linear.state, x.data_ptr(), x.shape[0], y.data_ptr())
    _check_status(status, "dense rows gemm", "a row-major fp32 weight or an x_fp32 grouped bf16 one")
    return y


def _operands(linear: NativeLinear, x: torch.Tensor, dtypes: tuple[torch.dtype, ...], kernel: str,
              named: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x checked for a GEMM over `linear` (contiguous) and its output [rows, out] in x's dtype."""
    if x.dim() != 2 or x.shape[1] != linear.in_features or x.dtype not in dtypes:
        raise ValueError(f"{kernel}: x must be [rows, {linear.in_features}] {named}, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    return x, torch.empty(x.shape[0], linear.out_features, dtype=x.dtype)


def _check_status(status: int, kernel: str, weight: str) -> None:
    """A GEMM's C status as an exception: -2 its activation copy failed to allocate; else nonzero: the weight is not
    what the kernel reads (or this build has no such kernel: 1)."""
    if status == -2:
        raise MemoryError(f"{kernel} could not allocate its activation copy")
    if status != 0:
        raise RuntimeError(f"{kernel} failed with status {status} (not {weight} in this build?)")
