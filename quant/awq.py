"""AWQ GEMM checkpoints (AutoAWQ, GPTQModel's AWQ, old quant_config.json).

Tensors per linear: qweight int32 [in, out/8] and qzeros int32 [groups, out/8], packed along the
output dim with the AWQ interleave; scales [groups, out]; optional bias. zero_point=false checkpoints
are symmetric: the implicit zero is 8 (GPTQModel still stores qzeros, all 8; we use them when present).
GEMV ("version": "gemv") uses another layout and is rejected at config time.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.quant.base import LinearMethod, QuantConfig, QuantConfigError
from pagedserve.quant.config_fields import get_bool, get_choice, get_int
from pagedserve.quant.group_quant import GroupQuantWeight
from pagedserve.quant.packed_linear import PackedLinearMethod
from pagedserve.quant.packing import default_g_idx, pack_cols, pack_rows, unpack_awq
from pagedserve.quant.unquantized import PlainLayersIn16Bit

log = logging.getLogger("pagedserve.quant")

F = "quantization_config"
AWQ_VERSIONS = ("gemm",)
KNOWN_OTHER_VERSIONS = ("gemv", "gemv_fast", "marlin", "exllama", "ipex", "llm-awq")


@dataclass(frozen=True, slots=True)
class AWQConfig(PlainLayersIn16Bit, QuantConfig):
    name = "awq"
    auto_lm_head_quantization = "q8_0"  # a 16-bit head is a large share of a 4-bit model's bytes a token
    bits: int
    group_size: int
    zero_point: bool = True
    modules_to_not_convert: tuple[str, ...] = ()
    kernel: str = "auto"
    plain_weights: torch.dtype | None = None  # PlainLayersIn16Bit: None, or 16-bit under fp32 compute

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise QuantConfigError(f"{F}.bits", f"{self.bits} is not supported for AWQ; supported: [4]")
        if self.group_size != -1 and self.group_size <= 0:
            raise QuantConfigError(f"{F}.group_size", f"{self.group_size} must be -1 or positive")

    @classmethod
    def from_hf(cls, qc: dict[str, Any]) -> "AWQConfig":
        qc = normalize_legacy_keys(qc)
        if "bits" not in qc:
            raise QuantConfigError(f"{F}.bits", "missing: an AWQ checkpoint must say how many bits it uses")
        version = qc.get("version") or qc.get("format") or "gemm"
        if isinstance(version, str) and version.lower() in KNOWN_OTHER_VERSIONS:
            raise QuantConfigError(f"{F}.version", f"AWQ {version!r} checkpoints use a different packing and "
                                   f"are not supported; supported: {list(AWQ_VERSIONS)} (re-export as GEMM)")
        get_choice(qc, "version", F, version, AWQ_VERSIONS)
        skip = qc.get("modules_to_not_convert") or ()
        if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
            raise QuantConfigError(f"{F}.modules_to_not_convert", f"expected a list of names, got {skip!r}")
        return cls(bits=get_int(qc, "bits", F), group_size=get_int(qc, "group_size", F, -1),
                   zero_point=get_bool(qc, "zero_point", F, True), modules_to_not_convert=tuple(skip))

    def linear_method(self, prefix: str) -> LinearMethod:
        # AutoAWQ's rule: a module stays fp16 when any listed name is a substring of its name.
        if prefix == "lm_head" or prefix.endswith(".lm_head") or any(s in prefix for s in self.modules_to_not_convert):
            return self.plain_linear_method()
        return AWQLinearMethod(prefix, self, self.kernel)

    def describe(self) -> str:
        return f"awq {self.bits}-bit group {self.group_size} zero_point={self.zero_point}"


def normalize_legacy_keys(qc: dict[str, Any]) -> dict[str, Any]:
    """AutoAWQ's quant_config.json spells bits/group_size as w_bit/q_group_size."""
    out = dict(qc)
    for old, new in (("w_bit", "bits"), ("q_group_size", "group_size")):
        if old in out and new not in out:
            out[new] = out.pop(old)
    return out


class AWQLinearMethod(PackedLinearMethod):
    CHECKPOINT_TENSORS = ("qweight", "qzeros", "scales")

    def __init__(self, prefix: str, config: AWQConfig, kernel: str = "auto"):
        super().__init__(prefix, kernel)
        self.config = config

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> None:
        if out_features % 8:
            raise QuantConfigError(self.prefix, f"out_features={out_features} is not a multiple of 8 "
                                   "(AWQ packs 8 output columns per int32)")
        g = self.config.group_size
        groups = 1 if g == -1 else math.ceil(in_features / g)
        layer.register_buffer("qweight", torch.empty(in_features, out_features // 8, dtype=torch.int32))
        layer.register_buffer("qzeros", torch.empty(groups, out_features // 8, dtype=torch.int32))
        layer.register_buffer("scales", torch.empty(groups, out_features, dtype=torch.float16))
        self._create_bias(layer, out_features, bias, dtype)

    def output_packing(self, name: str) -> int:
        return 8 if name in ("qweight", "qzeros") else 1  # 8 output columns per int32 (reordered within it)

    def required_checkpoint_tensors(self, layer: nn.Module) -> tuple[str, ...]:
        return ("qweight", "scales") + (("qzeros",) if self.config.zero_point else ())

    def to_group_quant(self, layer: nn.Module) -> GroupQuantWeight:
        if not bool(torch.isfinite(layer.scales).all()):
            raise QuantConfigError(f"{self.prefix}.scales", "contains inf or nan")
        q = unpack_awq(layer.qweight, 4)  # [in, out]
        if "qzeros" in layer.loaded_tensors:
            zeros = unpack_awq(layer.qzeros, 4)
            if not self.config.zero_point and not bool((zeros == 8).all()):
                log.warning("%s: zero_point=false but qzeros are not all 8; using the stored zeros", self.prefix)
        else:
            zeros = torch.full((layer.scales.shape[0], layer.out_features), 8, dtype=torch.int32)
        return GroupQuantWeight(qweight=pack_rows(q, 4), qzeros=pack_cols(zeros, 4), scales=layer.scales,
                                g_idx=default_g_idx(layer.in_features, self.config.group_size, q.device),
                                bits=4, in_features=layer.in_features, out_features=layer.out_features)

