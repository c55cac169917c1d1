"""Rotary embeddings: every scaling as one precomputed cos/sin table that the torch, native-step and Triton paths
all read (the Triton path is the torch model code over the Triton attention kernel; the native decode step indexes
the same buffers by row).

Each scaling's inverse frequencies follow transformers' modeling_rope_utils.py op for op, so fp32 tables are
bit-equal to the ones transformers computes. LongRoPE has two tables in one buffer, short rows then long rows:
a sequence whose length (all its known tokens, prompt included, so a chunked prefill picks as a whole prompt would)
exceeds `original_max_position_embeddings` reads the long rows, as transformers' `longrope_frequency_update` picks
by `max(position_ids) + 1` per forward; the scheduler recomputes a sequence that grows past it (transformers' Phi-3
drops its cache there) and the block manager keeps long and short sequences' prefix blocks apart. Dynamic NTK is
vLLM's: one base fixed for `factor * max_position_embeddings` positions (transformers rescales per sequence length
instead; its frequencies at that length are these).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.engine.errors import ModelLoadError
from pagedserve.kernels.layer_ops import LayerOps

SCALINGS = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class RopeParams:
    """One rotary embedding as a config describes it: `scaling` None for plain RoPE, else the rope_parameters /
    rope_scaling dict with `rope_type` and (for llama3, yarn, longrope) `original_max_position_embeddings` set."""

    theta: float
    scaling: Mapping[str, Any] | None = None
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ModelLoadError(f"partial_rotary_factor: {self.partial_rotary_factor!r}, expected in (0, 1]")
        kind = rope_type(self.scaling)
        if kind not in SCALINGS:
            raise ModelLoadError(f"rope_scaling.rope_type: unsupported {kind!r}; supported: {', '.join(SCALINGS)}")

    @property
    def kind(self) -> str:
        return rope_type(self.scaling)

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)

    def table_positions(self, max_position_embeddings: int) -> int:
        """Positions the table covers: vLLM's dynamic NTK serves `factor` times the configured context."""
        if self.kind == "dynamic":
            return int(max_position_embeddings * self.scaling["factor"])
        return max_position_embeddings


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def hf_rope(cfg: Mapping[str, Any], rope: Mapping[str, Any] | None = None, default_theta: float = 10000.0,
            aliases: Mapping[str, str] | None = None) -> RopeParams:
    """RopeParams from an HF config as transformers 5 standardizes it: `rope` (default: rope_parameters, else the
    older rope_scaling), rope_theta / partial_rotary_factor inside it or at the top level, and the pretraining
    length at the top level first (Phi-3 keeps it there), then inside, then max_position_embeddings. `aliases`
    renames a family's legacy type names (Phi-3: su and yarn mean longrope)."""
    params = dict(rope if rope is not None else (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}))
    kind = rope_type(params)
    kind = (aliases or {}).get(kind, kind)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if kind == "default":
        return RopeParams(theta, None, partial)
    params["rope_type"] = kind
    if kind in _NEEDS_ORIGINAL:
        original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original or cfg.get("max_position_embeddings")
    if kind in ("yarn", "longrope") and params.get("factor") is None:
        # transformers' fallback for both: the ratio of the served context to the pretraining one
        params["factor"] = cfg["max_position_embeddings"] / params["original_max_position_embeddings"]
    _require(params, kind)
    return RopeParams(theta, params, partial)


def _require(params: Mapping[str, Any], kind: str) -> None:
    needed = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings"),
              "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}.get(kind, ())
    for key in needed:
        if params.get(key) is None:
            raise ModelLoadError(f"rope_scaling.{key}: missing for rope_type {kind}")


def _default(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, scaling: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                     if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _longrope_attention(scaling: Mapping[str, Any]) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _longrope(dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    if len(factors) != dim // 2:
        raise ModelLoadError(f"rope_scaling: {len(factors)} LongRoPE factors, expected rotary_dim / 2 = {dim // 2}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**shape)


def _dynamic(dim: int, theta: float, scaling: Mapping[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]  # vLLM: the base for factor * max positions, i.e. (2 factor - 1) ** (d / (d - 2))
    base = theta * ((factor * factor) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inv_freqs(dim: int, params: RopeParams) -> tuple[tuple[torch.Tensor, ...], float]:
    """((inv_freq [dim/2],) or (short, long) for LongRoPE, the attention factor applied to cos and sin)."""
    base, scaling = _default(dim, params.theta), params.scaling
    kind = params.kind
    if kind == "default":
        return (base,), 1.0
    if kind == "linear":
        return (base / scaling["factor"],), 1.0
    if kind == "llama3":
        return (_llama3(base, scaling),), 1.0
    if kind == "yarn":
        freq, attention = _yarn(dim, params.theta, scaling)
        return (freq,), attention
    if kind == "dynamic":
        return (_dynamic(dim, params.theta, scaling),), 1.0
    pair = (_longrope(dim, params.theta, scaling["short_factor"]), _longrope(dim, params.theta, scaling["long_factor"]))
    return pair, _longrope_attention(scaling)


@dataclass(frozen=True, slots=True)
class RopeAngles:
    """cos and sign-folded sin of one step's tokens, [T, 1, rotary_dim] in the compute dtype; built once per forward.
    With partial rotary (rotary_dim < head_dim) only the first rotary_dim values of each head turn."""

    cos: torch.Tensor
    signed_sin: torch.Tensor  # sin with its first half negated: rotate_half's minus sign, folded in once
    ops: LayerOps

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, N, D] -> RoPE(x), same op order as transformers' (x * cos) + (rotate_half(x) * sin)."""
        dim = self.cos.shape[-1]
        if dim == x.shape[-1]:
            return self.ops.rope(x, self.cos, self.signed_sin)
        return torch.cat((self.ops.rope(x[..., :dim], self.cos, self.signed_sin), x[..., dim:]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE with cos/sin precomputed for every position (and, for LongRoPE, both
    factor sets: `long_offset` is the first long row, `long_after` the sequence length past which they apply)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Mapping[str, Any] | None,
                 partial_rotary_factor: float = 1.0):
        super().__init__()
        params = RopeParams(theta, scaling, partial_rotary_factor)
        self.head_dim, self.rotary_dim = head_dim, params.rotary_dim(head_dim)
        freqs, attention = inv_freqs(self.rotary_dim, params)
        rows = [max_positions]
        self.long_after: int | None = None
        if len(freqs) == 2:  # short rows are read only up to the pretraining length
            self.long_after = scaling["original_max_position_embeddings"]
            rows = [min(self.long_after, max_positions), max_positions]
        cos, sin = zip(*(_table(freq, count, attention) for freq, count in zip(freqs, rows)))
        self.long_offset = rows[0] if self.long_after is not None else 0
        half = self.rotary_dim // 2
        sin_all = torch.cat(sin)
        self.register_buffer("cos", torch.cat(cos), persistent=False)  # [rows, rotary_dim] fp32
        self.register_buffer("signed_sin", torch.cat((-sin_all[:, :half], sin_all[:, half:]), dim=-1), persistent=False)

    def table_rows(self, positions: torch.Tensor, seq_lengths: torch.Tensor | None) -> torch.Tensor:
        """positions [T] -> the table row of each (LongRoPE: long rows for tokens of sequences longer than
        long_after; `seq_lengths` [T], each token's sequence length)."""
        if self.long_after is None or seq_lengths is None:
            return positions
        return positions + (seq_lengths > self.long_after).to(positions.dtype) * self.long_offset

    def angles(self, positions: torch.Tensor, dtype: torch.dtype, ops: LayerOps,
               seq_lengths: torch.Tensor | None = None) -> RopeAngles:
        """positions [T] -> the step's RopeAngles, cast to `dtype` as transformers casts cos/sin."""
        rows = self.table_rows(positions, seq_lengths)
        return RopeAngles(self.cos[rows].to(dtype).unsqueeze(1), self.signed_sin[rows].to(dtype).unsqueeze(1), ops)


def _table(inv_freq: torch.Tensor, count: int, attention: float) -> tuple[torch.Tensor, torch.Tensor]:
    emb = torch.outer(torch.arange(count, dtype=torch.float32), inv_freq)
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos() * attention, emb.sin() * attention
