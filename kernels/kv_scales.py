"""FP8 KV-cache scales: read from the checkpoint when it has them, otherwise calibrated from the first prefill.

A scale is a dequantization factor: stored = real / scale, real = stored * scale (vLLM's and
compressed-tensors' convention). Accepted checkpoint names, for layer N (prefix `model.layers.N.self_attn`):
  .k_scale / .v_scale                  llm-compressor / compressed-tensors `kv_cache_scheme`, vLLM-style
  .attn.k_scale / .attn.v_scale        vLLM's own module naming
  .k_proj.k_scale / .v_proj.v_scale    NVIDIA ModelOpt
  .k_proj.output_scale / .v_proj.output_scale   older llm-compressor (output activation scales)
  .kv_scale                            deprecated AutoFP8: one scale for both K and V
Each may be per tensor (1 value), per KV head (num_kv_heads values, any shape) or per output channel
(num_kv_heads * head_dim values, reduced to the per-head max so no channel clips).

Calibration (when the checkpoint has none): the first write into each layer's cache (the first scheduled batch,
which always holds prefill tokens) fixes that layer's K offset and scales, by DEFAULT_RULE: K is centred (the batch's
per-channel mean, after the Hadamard rotation, is subtracted from every K stored; softmax ignores the constant Q.m
this takes from each query's scores), then per KV head scale = margin * amax(|x|) / fp8_max with margin 4, not
rounded. Neither ever changes afterwards, because values already stored depend on them; later values past the range
saturate. FP8 is floating point: its relative precision is the same at every magnitude, so the scale only places the
range. The margin keeps a 3-token first prompt from clipping a later text (on SmolLM2-135M, 512-token texts reached
1.7x the amax of a 44-token chat prompt) while e4m3 still keeps everything above amax / 7,000 normal. Over the
selection texts of benchmarks/fp8_texts.json this cut the KL divergence from the 16-bit-KV logits by about a fifth
against margin 1 without centring; docs/kv-cache-formats.md has the table of alternatives.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pagedserve.kernels.kv_cache import KVCache, KVCacheConfigError, KVDtype, LayerKVCache
from pagedserve.kernels.attention import AttentionImpl, WriteObservingAttention

logger = logging.getLogger(__name__)

_MIN_AMAX = 1e-6  # an all-zero head still needs a positive scale
_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\."
    r"(k_scale|v_scale|attn\.k_scale|attn\.v_scale|k_proj\.k_scale|v_proj\.v_scale"
    r"|k_proj\.output_scale|v_proj\.output_scale|kv_scale)$"
)


class KVScaleError(KVCacheConfigError):
    """Checkpoint KV scales are incomplete or malformed; the message names the tensor."""

    def __init__(self, message: str):
        super().__init__(f"kv scales: {message}")


@dataclass(frozen=True, slots=True)
class KVScales:
    """Per-layer dequantization scales, each [1] (per tensor) or [num_kv_heads], fp32."""

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    source: str  # where they came from, for the log line

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise KVScaleError(f"{len(self.k)} k scales but {len(self.v)} v scales")

    @property
    def granularity(self) -> str:
        return "per-tensor" if all(t.numel() == 1 for t in self.k + self.v) else "per-KV-head"

    def install(self, cache: KVCache) -> None:
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            cache.set_scales(layer, k, v)


def _per_head(name: str, tensor: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    flat = tensor.detach().to(torch.float32).reshape(-1)
    if flat.numel() == num_kv_heads * head_dim and flat.numel() not in (1, num_kv_heads):
        flat = flat.view(num_kv_heads, head_dim).amax(dim=1)
    if flat.numel() not in (1, num_kv_heads):
        raise KVScaleError(f"{name}: {tensor.numel()} values; expected 1, {num_kv_heads} or {num_kv_heads * head_dim}")
    if not bool(torch.isfinite(flat).all()) or bool((flat <= 0).any()):
        raise KVScaleError(f"{name}: scales must be finite and > 0")
    return flat


def scales_from_checkpoint(
    tensors: Mapping[str, torch.Tensor], num_layers: int, num_kv_heads: int, head_dim: int
) -> KVScales | None:
    """None when the checkpoint carries no K/V scales; an error when it carries some but not all layers'."""
    found: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _NAME.search(name)
        if match is None:
            continue
        layer, kind = int(match.group(1)), match.group(2)
        targets = ("k", "v") if kind == "kv_scale" else (kind.removeprefix("attn.")[0],)
        for target in targets:
            found.setdefault((layer, target), (name, tensor))
    if not found:
        return None
    k, v = [], []
    for layer in range(num_layers):
        for target, out in (("k", k), ("v", v)):
            if (layer, target) not in found:
                raise KVScaleError(f"layer {layer} has no {target}_scale but other layers do")
            out.append(_per_head(*found[(layer, target)], num_kv_heads, head_dim))
    extra = sorted({layer for layer, _ in found} - set(range(num_layers)))
    if extra:
        raise KVScaleError(f"scales for layer {extra[0]}, but the model has {num_layers} layers")
    return KVScales(tuple(k), tuple(v), source="checkpoint")


@dataclass(frozen=True, slots=True)
class ScaleRule:
    """How calibration turns observed K/V into dequantization scales.

    scale = margin * amax / fp8_max, per KV head (or one per tensor: the largest head's), optionally rounded up to
    a power of two. Values past the calibrated range saturate at +-fp8_max (the stores clamp)."""

    margin: float = 1.0
    power_of_two: bool = False
    per_tensor: bool = False
    center_k: bool = False  # subtract the calibration batch's per-channel K mean before quantizing (exact)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.margin) and self.margin > 0):
            raise KVScaleError(f"margin must be finite and > 0, got {self.margin}")

    def scales(self, amax: torch.Tensor, dtype: KVDtype) -> torch.Tensor:
        """amax [Hkv] (absolute maxima seen) -> scales [Hkv]."""
        amax = amax.float().clamp_min(_MIN_AMAX)
        if self.per_tensor:
            amax = amax.amax().expand_as(amax)
        scale = amax * (self.margin / dtype.fp8_max)
        return torch.exp2(torch.ceil(torch.log2(scale))) if self.power_of_two else scale

    def describe(self, dtype: KVDtype) -> str:
        rounding = ", rounded up to a power of two" if self.power_of_two else ""
        centred = "; K centred on the batch's per-channel mean" if self.center_k else ""
        return f"scale = {self.margin:g} x amax / {dtype.fp8_max:g}{rounding}{centred}"


DEFAULT_RULE = ScaleRule(margin=4.0, center_k=True)


def head_amax(x: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] -> |x| max per KV head [Hkv], fp32."""
    return x.detach().float().abs().amax(dim=(0, 2))


def calibrate_scales(x: torch.Tensor, dtype: KVDtype, rule: ScaleRule = DEFAULT_RULE) -> torch.Tensor:
    """x [T, Hkv, D] -> per-head scales [Hkv] under `rule`."""
    return rule.scales(head_amax(x), dtype)


def _describe(scales: list[torch.Tensor]) -> str:
    values = torch.cat([s.reshape(-1).float().cpu() for s in scales])
    return f"[{values.min().item():.3g}, {values.max().item():.3g}]"


class CalibratingAttention(WriteObservingAttention):
    """Wraps an implementation; the first write into each layer's cache fixes that layer's scales from its data."""

    def __init__(self, inner: AttentionImpl, cache: KVCache, rule: ScaleRule = DEFAULT_RULE):
        if not cache.spec.dtype.is_fp8:
            raise KVScaleError(f"calibration needs an fp8 cache, not {cache.spec.dtype.value}")
        super().__init__(inner)
        self.rule = rule
        self._pending = {id(layer): index for index, layer in enumerate(cache.layers)}
        self._layers = cache.layers
        self._tokens = 0

    @property
    def calibrated(self) -> bool:
        return not self._pending

    def cuda_graphs(self) -> bool:
        # Before calibration a write sets scales (and K's offset) from its data: capture only once they are fixed.
        return self.calibrated and self.inner.cuda_graphs()

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        index = self._pending.pop(id(cache), None)
        if index is not None:
            if self.rule.center_k:
                cache.k_offset = key.detach().float().mean(dim=0)
                key = key - cache.k_offset.to(key.dtype)  # later writes are centred by the entry point
            cache.k_scale.copy_(calibrate_scales(key, cache.dtype, self.rule))
            cache.v_scale.copy_(calibrate_scales(value, cache.dtype, self.rule))
            self._tokens = max(self._tokens, key.shape[0])
            if not self._pending:
                self._log_done()
        self.inner.write_kv(key, value, cache, slot_mapping)

    def _log_done(self) -> None:
        logger.warning(
            "FP8 KV cache (%s): %s scales CALIBRATED from the first prefill (%d tokens, %s): k_scale %s, "
            "v_scale %s; fixed from now on",
            self._layers[0].dtype.value, "per-tensor" if self.rule.per_tensor else "per-KV-head", self._tokens,
            self.rule.describe(self._layers[0].dtype),
            _describe([layer.k_scale for layer in self._layers]), _describe([layer.v_scale for layer in self._layers]),
        )


def hadamard(n: int) -> torch.Tensor | None:
    """The orthonormal Sylvester-Hadamard matrix [n, n] (symmetric, its own inverse); None unless n is 2^k."""
    if n < 1 or n & (n - 1):
        return None
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def setup_kv_scales(
    cache: KVCache, checkpoint_tensors: Mapping[str, torch.Tensor], impl: AttentionImpl,
    calibrate: bool = True, rule: ScaleRule = DEFAULT_RULE, rotate_k: bool = True,
) -> AttentionImpl:
    """Install checkpoint scales, or arrange calibration; returns the implementation the model must call.

    Call once after the KV cache and the attention implementation exist. Logs loudly which scales are in use.
    With calibrated scales, K is also rotated by a Hadamard matrix before quantization (QuaRot-style): K error
    dominates FP8 KV loss because a few channels carry most of Q.K, and the rotation spreads them over all
    channels (SmolLM2-135M, e4m3: KL from the fp16-KV logits 0.0111 -> 0.0054). Checkpoint scales were measured on
    unrotated K, so they are used without rotation.
    """
    spec = cache.spec
    scales = scales_from_checkpoint(checkpoint_tensors, spec.num_layers, spec.num_kv_heads, spec.head_dim)
    if spec.dtype.has_row_scales:
        _setup_row_scales(cache, scales is not None, rotate_k)
        return impl
    if not spec.dtype.is_fp8:
        if scales is not None:
            logger.info("checkpoint has k/v scales; unused because kv_cache_dtype is %s", spec.dtype.value)
        return impl
    if scales is not None:
        scales.install(cache)
        logger.warning(
            "FP8 KV cache (%s): k/v scales LOADED FROM CHECKPOINT (%s, %d layers): k_scale %s, v_scale %s",
            spec.dtype.value, scales.granularity, spec.num_layers, _describe(list(scales.k)), _describe(list(scales.v)),
        )
        return impl
    for layer in cache.layers:
        layer.k_offset = None  # offsets belong to calibrated scales, set with them
    if calibrate:
        rotation = hadamard(spec.head_dim) if rotate_k else None
        cache.set_k_rotation(rotation)
        logger.warning(
            "FP8 KV cache (%s): checkpoint has no k/v scales; CALIBRATING per-KV-head scales from the first prefill"
            "%s", spec.dtype.value, "; K rotated by a Hadamard transform before quantization" if rotation is not None else "",
        )
        return CalibratingAttention(impl, cache, rule)
    logger.warning(
        "FP8 KV cache (%s): NO k/v scales (all 1.0, calibration off): values beyond +-%g clamp and small ones lose "
        "precision",
        spec.dtype.value, spec.dtype.fp8_max,
    )
    return impl


def _setup_row_scales(cache: KVCache, checkpoint_has_scales: bool, rotate_k: bool) -> None:
    """int8 rows carry their own scales: nothing to load or calibrate. K is still rotated (a fixed matrix, no data):
    per-token int8 steps by the row's largest channel, and without the rotation K's outlier channels set it
    (SmolLM2-135M, fp32 compute, worst held-out text: top-1 97.9% without, 98.7% with; docs/kv-cache-formats.md)."""
    spec = cache.spec
    rotation = hadamard(spec.head_dim) if rotate_k else None
    cache.set_k_rotation(rotation)
    if checkpoint_has_scales:
        logger.info("checkpoint has FP8 k/v scales; unused because the int8 KV cache scales each row itself")
    logger.info("int8 KV cache: one fp16 scale per token and KV head, set at write time%s",
                "; K rotated by a Hadamard transform" if rotation is not None else "")
