"""Build a model from a local HF folder or a GGUF file: config -> architecture + quant method -> weights by name."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.host.cpu_features import effective_bf16_flags
from pagedserve.engine.loading.dtype_plan import DtypePlan, resolve_dtype
from pagedserve.engine.loading.gguf_checkpoint import GgufCheckpoint
from pagedserve.engine.models.checkpoint_layout import PLAIN, CheckpointLayout
from pagedserve.engine.models.registry import model_class_for
from pagedserve.kernels.cpu import packed as cpu_packed
from pagedserve.kernels.cpu.isa import IsaError
from pagedserve.kernels.cpu.native import NativeBuildError
from pagedserve.quant.base import QuantConfig, QuantConfigError
from pagedserve.quant.head_quant import quantize_lm_head, resolve_head_quantization
from pagedserve.quant.linear import QuantLinear
from pagedserve.quant.registry import quant_config_for

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# KV-cache quantization scales travel beside the weights (compressed-tensors and vLLM-style checkpoints).
_KV_SCALE_SUFFIXES = ("k_scale", "v_scale", "kv_scale", "q_scale", "prob_scale")
_KV_OUTPUT_SCALES = ("k_proj.output_scale", "v_proj.output_scale")  # older llm-compressor naming


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: nn.Module
    path: Path  # the HF folder or the .gguf file
    hf_config: dict[str, Any]
    dtype: torch.dtype  # the compute dtype
    quant: QuantConfig
    kv_scale_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    weight_dtype: torch.dtype | None = None  # the plain matrices' in memory, where it differs from `dtype`
    lm_head_quantization: str = "none"  # what `auto` resolved to: "none" (the head as stored) or "q8_0"


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"config.json in {model_dir}: {exc}") from None


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


def packed_gguf_types(gguf_weights: str, quantization: str | None, device: torch.device,
                      compute_dtype: torch.dtype, dtype_auto: bool = False) -> frozenset[str]:
    """The GGUF types served from their blocks (`gguf_weights`: auto, packed or dequantized): every type the packed
    CPU kernels read, or none. `auto` packs for 16-bit compute, for `--dtype auto` (on a CPU without bf16
    arithmetic that computes in fp32, and decode reading the blocks is still the fast path: 63 against 37.6 tok/s
    at one stream on a Zen 3) or `--quantization gguf`, on CPU where the kernels build; an explicit float32 stays
    the reference path (weights expanded at load, the matmuls transformers' greedy tokens are checked against),
    `--gguf-weights packed` takes the packed kernels there too."""
    wanted = gguf_weights == "packed" or (gguf_weights == "auto" and (compute_dtype != torch.float32 or dtype_auto
                                                                      or quantization == "gguf"))
    if not wanted or device.type != "cpu" or quantization not in (None, "gguf"):
        if gguf_weights == "packed":
            raise ModelLoadError(f"gguf_weights: packed needs the CPU and the gguf method "
                                 f"(device {device.type}, quantization {quantization})")
        return frozenset()
    try:
        cpu_packed.build()
    except NativeBuildError as exc:
        if gguf_weights == "packed":
            raise ModelLoadError(f"gguf_weights: packed, but the packed kernels do not build here ({exc})") from None
        logger.warning("packed GGUF kernels unavailable, dequantizing the weights at load: %s", exc)
        return frozenset()
    return frozenset(cpu_packed.FORMATS)


def load_model(path: Path, dtype: torch.dtype | None, quantization: str | None, device: torch.device,
               gguf_weights: str = "dequantized", lm_head_quantization: str = "none",
               pooling: bool = False) -> LoadedModel:
    """`path`: an HF folder (config.json + *.safetensors) or a .gguf file: matrices of the types the packed kernels
    read kept in their blocks as `packed_gguf_types` decides (EngineConfig's default is auto; this function's is
    every tensor dequantized once at load). `pooling`: the model embeds, so a checkpoint without an LM head (an
    embedding model saved from the bare decoder) loads; its head is never computed."""
    gguf = GgufCheckpoint(path) if is_gguf(path) else None
    hf_config = gguf.hf_config if gguf else read_hf_config(path)
    plan = resolve_dtype(hf_config, dtype, device, _cpu_bf16() if device.type == "cpu" and dtype is None else ())
    compute_dtype = plan.compute
    if gguf is not None:
        # auto: the blocks for decode rows and the expanded weights for batches; packed: the blocks alone.
        gguf.keep_packed(packed_gguf_types(gguf_weights, quantization, device, compute_dtype, dtype is None),
                         dense_batches=gguf_weights == "auto")
    factory = model_class_for(hf_config)
    try:
        # A GGUF names the gguf method when it keeps blocks; side files beside it are not its own.
        quant = quant_config_for(hf_config, quantization, None if gguf else path)
    except QuantConfigError as exc:
        raise ModelLoadError(str(exc)) from None
    quant = quant.holding_weights_in(plan.weights, compute_dtype)
    with torch.device(device):
        model = factory(hf_config, quant, compute_dtype)
    kv_scales = _load_weights(model, gguf.tensors(compute_dtype, plan.weights) if gguf else _safetensors(path),
                              head_optional=pooling)
    model.fuse_projections()
    head_format = resolve_head_quantization(lm_head_quantization, quant, getattr(model, "lm_head", None), device,
                                            _packed_kernels_build)
    if head_format != "none":
        _quantize_lm_head(model)
        logger.info("LM head multiplied from %s blocks made at load (lm_head_quantization=%s; none keeps it as "
                    "stored)", head_format, lm_head_quantization)
    _process_linear_layers(model)
    model.eval()
    logger.info("loaded %s (%s, %s, quantization=%s)", path, type(model).__name__, _describe(plan), quant.describe())
    return LoadedModel(model, path, hf_config, compute_dtype, quant, kv_scales,
                       None if plan.weights == compute_dtype else plan.weights, head_format)


def _cpu_bf16() -> tuple[str, ...]:
    try:
        return effective_bf16_flags()
    except IsaError as exc:  # PAGEDSERVE_CPU_ISA names a tier this host lacks
        raise ModelLoadError(str(exc)) from None


def _describe(plan: DtypePlan) -> str:
    if plan.weights == plan.compute:
        return str(plan.compute)
    return f"{plan.compute} compute, {plan.weights} weights"


def _safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files")
    for path in files:
        # A truncated or corrupt file fails at open or at the first tensor past its end: either way, name it.
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: unreadable safetensors file ({exc})") from None


def _load_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]],
                  head_optional: bool = False) -> dict[str, torch.Tensor]:
    modules = dict(model.named_modules())
    tied = getattr(model, "lm_head", 1) is None
    layout: CheckpointLayout = getattr(model, "checkpoint_layout", PLAIN)
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
    kv_scales: dict[str, torch.Tensor] = {}
    for stored_key, tensor in tensors:
        key = _bare_model_key(layout.module_key(stored_key), modules, layout)
        if key is None or key.endswith(_IGNORED_SUFFIXES) or (tied and key == "lm_head.weight"):
            continue
        if key.rsplit(".", 1)[-1] in _KV_SCALE_SUFFIXES or key.endswith(_KV_OUTPUT_SCALES):
            kv_scales[key] = tensor
            continue
        module_name, _, attr = key.rpartition(".")
        parts = () if module_name in modules else layout.fused_parts(module_name)
        if parts:
            _load_fused(modules, parts, key, attr, tensor, loaded)
        else:
            _load_one(modules, key, tensor, loaded)
    _check_complete(model, expected, loaded, ("lm_head",) if head_optional else ())
    return kv_scales


def _bare_model_key(key: str | None, modules: dict[str, nn.Module], layout: CheckpointLayout) -> str | None:
    """A checkpoint saved from the bare decoder (`Qwen3Model`: embedding models such as Qwen3-Embedding) names its
    tensors without the `model.` the causal-LM class puts before them (vLLM maps them the same way)."""
    if key is None or _names_module(key, modules, layout) or not _names_module("model." + key, modules, layout):
        return key
    return "model." + key


def _names_module(key: str, modules: dict[str, nn.Module], layout: CheckpointLayout) -> bool:
    module_name = key.rpartition(".")[0]
    return module_name in modules or bool(layout.fused_parts(module_name))


def _load_fused(modules: dict[str, nn.Module], parts: tuple[str, ...], key: str, attr: str, tensor: torch.Tensor,
                loaded: set[str]) -> None:
    """One tensor of a fused checkpoint module (Phi-3's qkv_proj) split into the model's linears `parts`."""
    layers = [modules.get(part) for part in parts]
    if not all(isinstance(layer, QuantLinear) for layer in layers):
        raise ModelLoadError(f"tensor {key}: no such module in the model (unexpected checkpoint tensor)")
    try:
        pieces = layers[0].method.split_output(attr, tensor, tuple(layer.out_features for layer in layers))
    except QuantConfigError as exc:
        raise ModelLoadError(f"tensor {key}: {exc}") from None
    for part, piece in zip(parts, pieces, strict=True):
        _load_one(modules, f"{part}.{attr}", piece.contiguous(), loaded)


def _packed_kernels_build() -> bool:
    try:
        cpu_packed.build()
        return True
    except NativeBuildError as exc:
        logger.warning("lm_head_quantization=auto keeps the head as stored: the packed kernels do not build (%s)", exc)
        return False


def _quantize_lm_head(model: nn.Module) -> None:
    try:
        cpu_packed.build()
        quantize_lm_head(model)
    except NativeBuildError as exc:
        raise ModelLoadError(f"lm_head_quantization: the packed kernels do not build here ({exc})") from None
    except QuantConfigError as exc:
        raise ModelLoadError(str(exc)) from None


def _process_linear_layers(model: nn.Module) -> None:
    """Repack every linear layer for its kernel: after fusing, so fused layers are packed once, whole."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            try:
                module.method.process_weights_after_loading(module)
            except QuantConfigError as exc:  # a tensor's values are wrong (e.g. g_idx out of range)
                raise ModelLoadError(str(exc)) from None


def _load_one(modules: dict[str, nn.Module], key: str, tensor: torch.Tensor, loaded: set[str]) -> None:
    module_name, _, attr = key.rpartition(".")
    module = modules.get(module_name)
    if module is None:
        raise ModelLoadError(f"tensor {key}: no such module in the model (unexpected checkpoint tensor)")
    if isinstance(module, QuantLinear):
        try:
            module.method.load_tensor(module, attr, tensor, module_name)
        except QuantConfigError as exc:
            raise ModelLoadError(str(exc)) from None
        return
    slot = getattr(module, attr, None)
    if not isinstance(slot, torch.Tensor):
        raise ModelLoadError(f"tensor {key}: the model has no such parameter")
    if tuple(slot.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"tensor {key}: shape {tuple(tensor.shape)}, expected {tuple(slot.shape)}")
    with torch.no_grad():
        slot.copy_(tensor)
    loaded.add(key)


def _check_complete(model: nn.Module, expected: set[str], loaded: set[str], optional: tuple[str, ...] = ()) -> None:
    """optional: modules that may be missing (left as allocated: never computed)."""
    expected -= {p for p in expected if p.rpartition(".")[0] in optional}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and name not in optional:
            missing = module.method.required_tensors(module) - module.loaded_tensors
            if missing:
                raise ModelLoadError(f"tensor {name}.{sorted(missing)[0]}: missing from the checkpoint")
            expected -= {f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)}
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"tensor {missing[0]}: missing from the checkpoint ({len(missing)} missing in all)")
