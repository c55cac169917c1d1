"""What GPTQ and AWQ share after loading: one canonical packed layout and the kernels that run it.

Each format converts its checkpoint tensors once, at load, into `GroupQuantWeight` (the gptq_v2
layout: qweight packed along the input dim, true zero points, g_idx), then a kernel from
`QLINEAR_KERNELS` repacks that into whatever it multiplies with. Weights stay packed: no kernel keeps a
dequantized copy. The `dequant` kernel, which dequantizes on every call, is the reference and the
fallback for shapes or bit widths the fast kernels cannot take (chosen with a logged reason).
"""

from __future__ import annotations

import logging
import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from pagedserve.kernels.registry import Registry
from pagedserve.quant.base import LinearMethod, QuantConfigError
from pagedserve.quant.packing import gptq_dequantize, pack_factor, pack_rows, unpack_cols, unpack_rows

log = logging.getLogger("pagedserve.quant")


@dataclass(frozen=True, slots=True)
class GroupQuantWeight:
    """W[out, in] = (q - z)[g_idx] * s[g_idx], transposed; q and z unsigned `bits`-bit integers."""

    qweight: torch.Tensor  # int32 [in / pf, out], field i of row r = input 8r+i (4-bit)
    qzeros: torch.Tensor  # int32 [groups, out / pf], true zero points (no v1 "-1")
    scales: torch.Tensor  # float [groups, out]
    g_idx: torch.Tensor  # int32 [in]
    bits: int
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        pf = pack_factor(self.bits)
        groups = self.scales.shape[0]
        expect = {"qweight": (self.in_features // pf, self.out_features),
                  "qzeros": (groups, self.out_features // pf),
                  "scales": (groups, self.out_features), "g_idx": (self.in_features,)}
        for name, shape in expect.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise QuantConfigError(name, f"canonical shape {got} != {shape}")

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return gptq_dequantize(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, 0, dtype)


def sorted_groups(g_idx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(perm or None, g_idx in kernel order): perm sorts input channels by group when g_idx is not
    already non-decreasing (act-order)."""
    g = g_idx.long()
    if g.numel() < 2 or bool((g[1:] >= g[:-1]).all()):
        return None, g
    perm = torch.argsort(g, stable=True)
    return perm, g.index_select(0, perm)


def run_block(sorted_g: torch.Tensor, min_block: int = 8) -> int | None:
    """Largest block size dividing every run of equal groups (so each block lies in one group), or
    None when that is below `min_block` (per-block scales would approach a dense tensor)."""
    _, counts = torch.unique_consecutive(sorted_g, return_counts=True)
    block = math.gcd(*counts.tolist()) if counts.numel() > 1 else int(counts[0])
    return block if block >= min_block else None


class QLinearKernel(nn.Module):
    """A packed weight in a kernel's own layout; forward: x [M, in] -> [M, out] (no bias)."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def unsupported_reason(cls, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when this kernel can run `w`; otherwise why not (logged when falling back)."""

    @classmethod
    @abstractmethod
    def from_weight(cls, w: GroupQuantWeight, dtype: torch.dtype) -> "QLinearKernel":
        ...

    def weight_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


QLINEAR_KERNELS: Registry[type[QLinearKernel]] = Registry("quantized linear kernel")


@QLINEAR_KERNELS.register("dequant")
class DequantKernel(QLinearKernel):
    """Keeps the weight packed and dequantizes it on every call, then a dense matmul: the fallback for
    what the fast kernels cannot take (8-bit, float32 activations on CPU, odd shapes).

    Prepared once: input rows sorted by group (act-order permutes the activations instead) and cut into
    blocks of `block` rows, each inside one group, so a call is an unpack, one fused multiply-subtract
    with per-block scale and scale*zero, and the matmul. Irregular groupings use g_idx per row."""

    name = "dequant"

    def __init__(self, w: GroupQuantWeight):
        super().__init__()
        self.bits, self.in_features, self.out_features = w.bits, w.in_features, w.out_features
        perm, sorted_g = sorted_groups(w.g_idx)
        self.block = run_block(sorted_g)
        if self.block is None:
            self.register_buffer("perm", None)
            for field in ("qweight", "qzeros", "scales", "g_idx"):
                self.register_buffer(field, getattr(w, field))
            return
        q = unpack_rows(w.qweight, w.bits)
        self.register_buffer("perm", None if perm is None else perm.to(torch.int32))
        self.register_buffer("qweight", pack_rows(q if perm is None else q.index_select(0, perm), w.bits))
        # Per group, not per block: a partial last group would otherwise double the scale bytes.
        self.register_buffer("block_group", sorted_g[:: self.block].to(torch.int32))
        self.register_buffer("scales", w.scales)
        self.register_buffer("qzeros", w.qzeros)

    @classmethod
    def unsupported_reason(cls, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        return None

    @classmethod
    def from_weight(cls, w: GroupQuantWeight, dtype: torch.dtype) -> "DequantKernel":
        return cls(w)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W.T [in (sorted by group), out]; transient, never stored."""
        if self.block is None:
            return GroupQuantWeight(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits,
                                    self.in_features, self.out_features).dequantize(dtype).t()
        scale = self.scales.index_select(0, self.block_group).to(torch.float32)  # [K / block, N]
        zero = unpack_cols(self.qzeros, self.bits).index_select(0, self.block_group)
        scaled_zero = zero.to(torch.float32) * scale  # exact: fp16 scale x small integer
        q = unpack_rows(self.qweight, self.bits).view(-1, self.block, self.out_features)
        w = torch.addcmul(-scaled_zero.unsqueeze(1), q.to(torch.float32), scale.unsqueeze(1))
        return w.view(self.in_features, self.out_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 2 and x.shape[1] == self.in_features, (x.shape, self.in_features)
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        return torch.mm(x, self.dense_weight(x.dtype))


def auto_kernel_order(device: torch.device) -> tuple[str, ...]:
    if device.type == "cuda":
        return ("vendor", "triton", "dequant")
    return ("cpu_int4", "dequant")


def _import_kernels() -> None:
    # Registering is a side effect of import; kept lazy so that pagedserve.quant imports without triton.
    from pagedserve.quant import cpu_int4  # noqa: F401

    try:
        from pagedserve.quant import triton_gemm  # noqa: F401
    except ImportError as exc:  # triton missing: the CUDA path falls back to dequant
        log.debug("triton kernels unavailable: %s", exc)
    from pagedserve.quant import vendor_kernels  # noqa: F401


_warned: set[str] = set()


def select_kernel(requested: str, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype,
                  prefix: str) -> type[QLinearKernel]:
    """`requested` is a kernel name or "auto" (first supported in auto_kernel_order)."""
    _import_kernels()
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
    for name in auto_kernel_order(device):
        if name not in QLINEAR_KERNELS:
            continue
        cls = QLINEAR_KERNELS.get(name)
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


class PackedLinearMethod(LinearMethod):
    """Shared load / post-process / apply for GPTQ and AWQ; subclasses define the checkpoint tensors
    and how they become a GroupQuantWeight."""

    CHECKPOINT_TENSORS: ClassVar[tuple[str, ...]]

    def __init__(self, prefix: str, kernel: str = "auto"):
        self.prefix = prefix
        self.kernel = kernel

    def load_tensor(self, layer: nn.Module, name: str, tensor: torch.Tensor, prefix: str) -> None:
        slot = getattr(layer, name, None) if name in self.CHECKPOINT_TENSORS + ("bias",) else None
        if not isinstance(slot, torch.Tensor):
            raise QuantConfigError(f"{prefix}.{name}", f"unexpected tensor for {type(self).__name__}")
        if tuple(slot.shape) != tuple(tensor.shape):
            raise QuantConfigError(f"{prefix}.{name}",
                                   f"shape {tuple(tensor.shape)} does not match expected {tuple(slot.shape)}")
        if slot.dtype == torch.int32 and tensor.dtype != torch.int32:
            raise QuantConfigError(f"{prefix}.{name}", f"dtype {tensor.dtype}, expected torch.int32")
        if slot.is_floating_point() and not tensor.is_floating_point():
            raise QuantConfigError(f"{prefix}.{name}", f"dtype {tensor.dtype}, expected a float tensor")
        # Float tensors keep the checkpoint's dtype (fp16 scales stay exact); ints are copied as is.
        setattr(layer, name, tensor.detach().to(slot.device).clone())
        layer.loaded_tensors.add(name)

    def _create_bias(self, layer: nn.Module, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        # GPTQ tools write a (zero) bias for every linear even where the architecture has none, so a bias
        # tensor is always accepted and only required when the layer has one.
        layer.register_buffer("bias", torch.zeros(out_features, dtype=dtype))
        layer.bias_required = bias
        layer.compute_dtype = dtype

    def required_tensors(self, layer: nn.Module) -> set[str]:
        names = set(self.required_checkpoint_tensors(layer))
        if layer.bias_required:
            names.add("bias")
        return names

    @abstractmethod
    def required_checkpoint_tensors(self, layer: nn.Module) -> tuple[str, ...]:
        ...

    @abstractmethod
    def to_group_quant(self, layer: nn.Module) -> GroupQuantWeight:
        """Validate the loaded tensors and convert them to the canonical layout."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = self.to_group_quant(layer)
        for name in self.CHECKPOINT_TENSORS:
            if hasattr(layer, name):
                delattr(layer, name)
        if "bias" not in layer.loaded_tensors or not bool(layer.bias.any()):
            layer.bias = None
        else:
            layer.bias = layer.bias.to(layer.compute_dtype)
        device = w.qweight.device
        cls = select_kernel(self.kernel, w, device, layer.compute_dtype, self.prefix)
        layer.qkernel = cls.from_weight(w, layer.compute_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = layer.qkernel(x.reshape(-1, x.shape[-1]))
        if layer.bias is not None:
            y = y + layer.bias.to(y.dtype)
        return y.reshape(*lead, y.shape[-1])
