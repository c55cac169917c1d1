"""`SpeculativeConfig`: what `--speculative-config '<json>'` sets, with vLLM's keys and meanings.

`EngineConfig.speculative is None` means speculation is off. Only the n-gram prompt-lookup method exists; a draft
model would add a method name and a proposer behind the same `Drafter` seam (docs/speculative-decoding.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from pagedserve.engine.errors import ConfigError

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16
# Steps with more running sequences than this do not speculate. One: a draft row is close to free only while a step
# waits on reading the weights, which holds for one stream on every path and host measured (the copy workload
# 1.7-2.2x); from two streams on, what a draft row costs depends on the host's matrix units and the weights' kernel
# (its integer dots on the native step, bf16 GEMM rows on the torch path), and text that copies little loses
# (docs/speculative-decoding.md has the tables and the command that finds a host's own crossover).
DEFAULT_DISABLE_BY_BATCH_SIZE = 1


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`num_speculative_tokens`: drafts per step (k); `prompt_lookup_min` / `prompt_lookup_max`: the shortest and
    longest suffix n-gram looked up (either alone sets both, none: 5 and 5, as vLLM does); `disable_by_batch_size`:
    a step with more running sequences than this speculates for none of them (None: DEFAULT_DISABLE_BY_BATCH_SIZE);
    `adaptive_drafts` (pagedserve's own key): up to k drafts by the length of the n-gram match (`ngram.draft_count`),
    else k whenever the text after the match has them."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    adaptive_drafts: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError("speculative_config.method", f"unknown {self.method!r}; supported: {', '.join(METHODS)}")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ConfigError("speculative_config.num_speculative_tokens",
                              f"must be <= {MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        _positive("prompt_lookup_min", lo)
        _positive("prompt_lookup_max", hi)
        if lo > hi:
            raise ConfigError("speculative_config.prompt_lookup_min", f"{lo} exceeds prompt_lookup_max {hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if self.disable_by_batch_size is not None:
            _positive("disable_by_batch_size", self.disable_by_batch_size)
        if not isinstance(self.adaptive_drafts, bool):
            raise ConfigError("speculative_config.adaptive_drafts", f"must be true or false, got {self.adaptive_drafts!r}")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """vLLM's `--speculative-config` JSON object; unknown keys are refused by name."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("speculative_config", f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("speculative_config", "must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"speculative_config.{unknown[0]}", f"unknown key; supported: {', '.join(sorted(known))}")
        if "num_speculative_tokens" not in data:
            raise ConfigError("speculative_config.num_speculative_tokens", "is required")
        return cls(**data)


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"speculative_config.{name}", f"must be an integer >= 1, got {value!r}")
