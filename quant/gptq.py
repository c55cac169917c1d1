"""GPTQ checkpoints (AutoGPTQ, GPTQModel "gptq" / "gptq_v2", TheBloke-era quantize_config.json).

Tensors per linear: qweight int32 [in/pf, out], qzeros int32 [groups, out/pf], scales [groups, out],
g_idx int32 [in] (required with desc_act), optional bias [out]. groups = ceil(in / group_size), or 1 for
group_size -1. Zero points: "gptq" (v1) stores z-1, "gptq_v2" stores z. Some checkpoints are labelled
"gptq" but hold v2 zeros (symmetric 4-bit with every stored zero 8 rather than 7); a symmetric
checkpoint's zeros are known, so each layer checks which convention its stored zeros follow.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pagedserve.quant.base import LinearMethod, QuantConfig, QuantConfigError
from pagedserve.quant.config_fields import get_bool, get_choice, get_int
from pagedserve.quant.group_quant import GroupQuantWeight
from pagedserve.quant.packed_linear import PackedLinearMethod
from pagedserve.quant.packing import default_g_idx, pack_cols, pack_factor, unpack_cols
from pagedserve.quant.unquantized import PlainLayersIn16Bit

log = logging.getLogger("pagedserve.quant")

GPTQ_BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
F = "quantization_config"


@dataclass(frozen=True, slots=True)
class GPTQLayerSpec:
    bits: int
    group_size: int
    desc_act: bool
    sym: bool

    def __post_init__(self) -> None:
        if self.bits not in GPTQ_BITS:
            raise QuantConfigError(f"{F}.bits", f"{self.bits} is not supported; supported: {list(GPTQ_BITS)}")
        if self.group_size != -1 and self.group_size <= 0:
            raise QuantConfigError(f"{F}.group_size", f"{self.group_size} must be -1 or positive")


@dataclass(frozen=True, slots=True)
class GPTQConfig(PlainLayersIn16Bit, QuantConfig):
    name = "gptq"
    auto_lm_head_quantization = "q8_0"  # a 16-bit head is a large share of a 4-bit model's bytes a token
    spec: GPTQLayerSpec
    checkpoint_format: str = "gptq"
    lm_head: bool = False
    # GPTQModel "dynamic": regex -> overrides; a "-:" prefix means "leave this module unquantized".
    dynamic: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    kernel: str = "auto"
    plain_weights: torch.dtype | None = None  # PlainLayersIn16Bit: None, or 16-bit under fp32 compute

    def __post_init__(self) -> None:
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise QuantConfigError(f"{F}.checkpoint_format",
                                   f"{self.checkpoint_format!r} is not supported; supported: {list(CHECKPOINT_FORMATS)}")

    @classmethod
    def from_hf(cls, qc: dict[str, Any]) -> "GPTQConfig":
        if "bits" not in qc:
            raise QuantConfigError(f"{F}.bits", "missing: a GPTQ checkpoint must say how many bits it uses")
        if qc.get("is_marlin_format"):
            raise QuantConfigError(f"{F}.is_marlin_format", "Marlin-repacked GPTQ checkpoints are not supported; "
                                   "supported: plain GPTQ (checkpoint_format gptq or gptq_v2)")
        pack_dtype = qc.get("pack_dtype", "int32")
        if pack_dtype != "int32":
            raise QuantConfigError(f"{F}.pack_dtype", f"{pack_dtype!r} is not supported; supported: ['int32']")
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        spec = GPTQLayerSpec(bits=get_int(qc, "bits", F), group_size=get_int(qc, "group_size", F, -1),
                             desc_act=get_bool(qc, "desc_act", F, False), sym=get_bool(qc, "sym", F, True))
        return cls(spec=spec, checkpoint_format=get_choice(qc, "checkpoint_format", F, fmt, CHECKPOINT_FORMATS),
                   lm_head=get_bool(qc, "lm_head", F, False), dynamic=_parse_dynamic(qc.get("dynamic")))

    def spec_for(self, prefix: str) -> GPTQLayerSpec | None:
        """The layer's settings, or None when it stays unquantized."""
        if prefix == "lm_head" or prefix.endswith(".lm_head"):
            if not self.lm_head:
                return None
        for pattern, overrides in self.dynamic:
            if pattern.startswith("-:") and re.match(pattern[2:], prefix):
                return None
        for pattern, overrides in self.dynamic:
            if not pattern.startswith("-:") and re.match(pattern.removeprefix("+:"), prefix):
                return replace(self.spec, **dict(overrides))
        return self.spec

    def stores_tied_head(self) -> bool:
        return self.lm_head

    def linear_method(self, prefix: str) -> LinearMethod:
        spec = self.spec_for(prefix)
        if spec is None:
            return self.plain_linear_method()
        return GPTQLinearMethod(prefix, spec, self.checkpoint_format, self.kernel)

    def describe(self) -> str:
        s = self.spec
        return (f"gptq {s.bits}-bit group {s.group_size} desc_act={s.desc_act} sym={s.sym} "
                f"format={self.checkpoint_format}")


# GPTQModel `dynamic` keys that steer how the tool searched for the weights, not how they are stored: GPTQModel
# 7.3.6 writes {"lm_head": {"bits": 8, "group_size": 32, "sym": true, "desc_act": false, "mse": 2.4}} for
# lm_head=True unless told otherwise. They are read past; unknown keys are still refused.
_SEARCH_ONLY = frozenset({"mse", "damp_percent", "damp_auto_increment", "static_groups", "true_sequential",
                          "act_group_aware", "gptaq", "foem", "hessian", "fallback"})


def _parse_dynamic(dynamic: Any) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    if not dynamic:
        return ()
    if not isinstance(dynamic, dict):
        raise QuantConfigError(f"{F}.dynamic", f"expected an object of regex -> overrides, got {type(dynamic).__name__}")
    allowed = {"bits", "group_size", "desc_act", "sym"}
    out = []
    for pattern, overrides in dynamic.items():
        overrides = overrides or {}
        unknown = set(overrides) - allowed - _SEARCH_ONLY
        if unknown and not pattern.startswith("-:"):
            raise QuantConfigError(f"{F}.dynamic[{pattern!r}]",
                                   f"unsupported override(s) {sorted(unknown)}; supported: {sorted(allowed)}")
        out.append((pattern, tuple(sorted((k, v) for k, v in overrides.items() if k in allowed))))
    return tuple(out)


class GPTQLinearMethod(PackedLinearMethod):
    CHECKPOINT_TENSORS = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, prefix: str, spec: GPTQLayerSpec, checkpoint_format: str, kernel: str = "auto"):
        super().__init__(prefix, kernel)
        self.spec = spec
        self.checkpoint_format = checkpoint_format

    def num_groups(self, in_features: int) -> int:
        return 1 if self.spec.group_size == -1 else math.ceil(in_features / self.spec.group_size)

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> None:
        pf = pack_factor(self.spec.bits)
        for dim, size in (("in_features", in_features), ("out_features", out_features)):
            if size % pf:
                raise QuantConfigError(self.prefix, f"{dim}={size} is not a multiple of {pf} "
                                       f"({self.spec.bits}-bit values packed in int32 words)")
        groups = self.num_groups(in_features)
        layer.register_buffer("qweight", torch.empty(in_features // pf, out_features, dtype=torch.int32))
        layer.register_buffer("qzeros", torch.empty(groups, out_features // pf, dtype=torch.int32))
        layer.register_buffer("scales", torch.empty(groups, out_features, dtype=torch.float16))
        layer.register_buffer("g_idx", default_g_idx(in_features, self.spec.group_size))
        self._create_bias(layer, out_features, bias, dtype)

    def output_packing(self, name: str) -> int:
        return pack_factor(self.spec.bits) if name == "qzeros" else 1  # qweight packs inputs, qzeros outputs

    def required_checkpoint_tensors(self, layer: nn.Module) -> tuple[str, ...]:
        # Without act-order g_idx is implied (i // group_size); with it the permutation must be stored.
        return ("qweight", "qzeros", "scales") + (("g_idx",) if self.spec.desc_act else ())

    def zero_offset(self, stored: torch.Tensor) -> int:
        """1 for v1 (stored z-1), 0 for v2; a symmetric layer's stored zeros reveal which one it is."""
        labelled = 1 if self.checkpoint_format == "gptq" else 0
        if not self.spec.sym:
            return labelled
        mid = 1 << (self.spec.bits - 1)
        if bool((stored == mid - 1).all()):
            found = 1
        elif bool((stored == mid).all()):
            found = 0
        else:  # zeros vary although sym=true: the data cannot say, trust the label like the tools do
            log.warning("%s: sym=true but the stored zero points vary; trusting checkpoint_format %r",
                        self.prefix, self.checkpoint_format)
            return labelled
        if found != labelled:
            log.warning("%s: checkpoint_format says %r but the stored zeros are %s-style; using %s",
                        self.prefix, self.checkpoint_format, "v1" if found else "v2", "v1" if found else "v2")
        return found

    def to_group_quant(self, layer: nn.Module) -> GroupQuantWeight:
        bits, groups = self.spec.bits, layer.scales.shape[0]
        g_idx = layer.g_idx
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise QuantConfigError(f"{self.prefix}.g_idx", f"values must lie in [0, {groups}), "
                                   f"got [{int(g_idx.min())}, {int(g_idx.max())}]")
        if not bool(torch.isfinite(layer.scales).all()):
            raise QuantConfigError(f"{self.prefix}.scales", "contains inf or nan")
        stored = unpack_cols(layer.qzeros, bits)
        zeros = (stored + self.zero_offset(stored)) & ((1 << bits) - 1)
        return GroupQuantWeight(qweight=layer.qweight, qzeros=pack_cols(zeros, bits), scales=layer.scales,
                                g_idx=g_idx.to(torch.int32), bits=bits, in_features=layer.in_features,
                                out_features=layer.out_features)

