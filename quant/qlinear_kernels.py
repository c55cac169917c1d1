"""Quantized linear kernels by name, and the `auto` choice among them for one layer.

This module is where kernels are registered (one line for a new one); kernel modules import only the interface in
group_quant.py, never this module. The Triton kernel's module is imported on first lookup only, so that processes
that never ask for it (every CPU process) never import triton. On CUDA the order between the decode kernels is
w4a16_rule.RULE's.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import torch

from pagedserve.kernels.registry import Registry
from pagedserve.quant.base import QuantConfigError
from pagedserve.quant.cpu_group_kernel import CpuGroupKernel
from pagedserve.quant.cpu_int4 import CpuInt4Kernel
from pagedserve.quant.group_quant import DequantKernel, GroupQuantWeight, QLinearKernel
from pagedserve.quant.tinygemm import TinyGemmKernel
from pagedserve.quant.vendor_kernels import AwqExtKernel

log = logging.getLogger("pagedserve.quant")


def _triton_kernel() -> type[QLinearKernel]:
    return importlib.import_module("pagedserve.quant.triton_gemm").TritonGemmKernel


def _w4a16_kernel() -> type[QLinearKernel]:
    return importlib.import_module("pagedserve.quant.w4a16_kernel").W4A16Kernel


QLINEAR_KERNELS: Registry[type[QLinearKernel]] = Registry("quantized linear kernel")
QLINEAR_KERNELS.register("dequant")(DequantKernel)
QLINEAR_KERNELS.register("cpu_int4")(CpuInt4Kernel)
QLINEAR_KERNELS.register("cpu_group")(CpuGroupKernel)
QLINEAR_KERNELS.register("vendor")(AwqExtKernel)
QLINEAR_KERNELS.register("tinygemm")(TinyGemmKernel)
if importlib.util.find_spec("triton") is not None:  # without triton, the CUDA path falls back to dequant
    QLINEAR_KERNELS.register_lazy("triton", _triton_kernel)
    QLINEAR_KERNELS.register_lazy("w4a16", _w4a16_kernel)


def auto_kernel_order(device: torch.device, dtype: torch.dtype = torch.float16) -> tuple[str, ...]:
    if device.type == "cuda":
        # triton (per-element group lookup) takes what the decode layout refuses: non-uniform hand-made g_idx.
        return ("vendor", "w4a16", "triton", "dequant")
    # cpu_group: any bits and dtype, the native decode step's kernel; cpu_int4 where a layer's groups don't fit it.
    return ("cpu_group", "cpu_int4", "dequant")


_warned: set[str] = set()


def select_kernel(requested: str, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype,
                  prefix: str) -> type[QLinearKernel]:
    """`requested` is a kernel name or "auto" (first supported in auto_kernel_order)."""
    if requested != "auto":
        try:
            cls = QLINEAR_KERNELS.get(requested)
        except LookupError as exc:
            raise QuantConfigError("kernel", str(exc)) from None
        reason = cls.unsupported_reason(w, device, dtype)
        if reason is not None:
            raise QuantConfigError(prefix, f"kernel {requested!r} cannot run this layer: {reason}")
        return cls
    reasons = []
    for name in auto_kernel_order(device, dtype):
        if name not in QLINEAR_KERNELS:
            continue
        try:
            cls = QLINEAR_KERNELS.get(name)
        except ImportError as exc:  # an installed but broken triton: fall back, saying why
            reasons.append(f"{name}: cannot import ({exc})")
            continue
        reason = cls.unsupported_reason(w, device, dtype)
        if reason is None:
            if reasons:
                _log_fallback(prefix, name, reasons)
            return cls
        reasons.append(f"{name}: {reason}")
    raise QuantConfigError(prefix, "no quantized linear kernel can run this layer: " + "; ".join(reasons))


def _log_fallback(prefix: str, chosen: str, reasons: list[str]) -> None:
    msg = f"using the {chosen!r} kernel ({'; '.join(reasons)})"
    if chosen == "dequant":
        msg += " - weights stay packed and are dequantized on every call, which is slow"
    if msg not in _warned:  # once per distinct reason, not once per layer
        _warned.add(msg)
        log.warning("%s: %s (further layers with the same reason are logged at debug level)", prefix, msg)
    else:
        log.debug("%s: %s", prefix, msg)
