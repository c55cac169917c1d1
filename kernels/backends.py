"""The kernels' registries: attention implementations and layer ops by name, and the `auto` choice for each.

This module is the one place implementations are registered (and the one line to add for a new one): they import
only the interfaces (attention.py, layer_ops.py), never this module, so no import cycle exists. engine/config.py
validates its names against these registries, and each implementation's `requirements` (requirements.py).
"""

from __future__ import annotations

import importlib

import torch

from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.attention import AttentionImpl
from pagedserve.kernels.cpu.layer_ops import NATIVE_DTYPES, NativeLayerOps
from pagedserve.kernels.layer_ops import LayerOps, TorchLayerOps
from pagedserve.kernels.native_attention import NativeCpuAttention
from pagedserve.kernels.registry import Registry
from pagedserve.kernels.requirements import Requirements
from pagedserve.kernels.torch_attention import TorchAttention
from pagedserve.kernels.triton_backend import TritonAttention, triton_available

ATTENTION_IMPLS: Registry[type[AttentionImpl]] = Registry("attention implementation")
ATTENTION_IMPLS.register("torch")(TorchAttention)
ATTENTION_IMPLS.register("native")(NativeCpuAttention)
if triton_available():  # CPU installs without triton never see the name
    ATTENTION_IMPLS.register("triton")(TritonAttention)

LAYER_OPS: Registry[type[LayerOps]] = Registry("layer ops")
LAYER_OPS.register("torch")(TorchLayerOps)
LAYER_OPS.register("native")(NativeLayerOps)
if triton_available():  # imported on first lookup: CPU processes that never ask never import triton
    LAYER_OPS.register_lazy("triton", lambda: importlib.import_module("pagedserve.kernels.triton_layer_ops")
                            .TritonLayerOps)

AUTO = "auto"


def attention_backend_names() -> tuple[str, ...]:
    return (AUTO, *ATTENTION_IMPLS.names())


def layer_ops_names() -> tuple[str, ...]:
    return (AUTO, *LAYER_OPS.names())


def attention_requirements(name: str) -> Requirements:
    """What the named implementation needs of the config (`auto` picks one that fits, so nothing)."""
    return Requirements() if name == AUTO else ATTENTION_IMPLS.get(name).requirements


def layer_ops_requirements(name: str) -> Requirements:
    return Requirements() if name == AUTO else LAYER_OPS.get(name).requirements


def select_attention_impl(name: str, device: torch.device) -> AttentionImpl:
    """`auto` picks Triton on CUDA (when importable), the native CPU kernels on CPU (when they build here) and
    torch otherwise; other names are explicit."""
    if name == AUTO:
        if device.type == "cuda":
            name = "triton" if "triton" in ATTENTION_IMPLS else "torch"
        else:
            name = "native" if device.type == "cpu" and cpu_native.available() else "torch"
    return ATTENTION_IMPLS.get(name)()


def select_layer_ops(name: str, device: torch.device, dtype: torch.dtype) -> LayerOps:
    """`auto`: native for CPU models (fp32, bf16, fp16) when the C kernels build here; Triton for 16-bit CUDA models
    (fp32 keeps torch's ops, bit for bit with transformers); torch otherwise."""
    if name == AUTO:
        if device.type == "cuda":
            name = "triton" if dtype in (torch.float16, torch.bfloat16) and "triton" in LAYER_OPS else "torch"
        else:
            wanted = device.type == "cpu" and dtype in NATIVE_DTYPES
            name = "native" if wanted and cpu_native.available() else "torch"
    return LAYER_OPS.get(name)()
