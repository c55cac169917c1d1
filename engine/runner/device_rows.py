"""What async scheduling's sampler leaves on the device for one step (`Sampler.device_picks`), and its host copy:
each row's token, whether its logits were finite and, for requests that asked, the chosen token's logprob and the
top ones. The copy to the host is started at once and waited for only when the step's tokens are read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class HostRows:
    tokens: list[int]
    finite: list[bool]
    chosen: list[float] | None = None  # each row's logprob of its token (None: no row asked for logprobs)
    top_values: list[list[float]] | None = None  # [R][K]: the K best logprobs, best first (K: the most any row asked)
    top_ids: list[list[int]] | None = None
    failed: Mapping[int, str] = field(default_factory=dict)  # rows whose own rules or draw raised: their errors


@dataclass(frozen=True, slots=True)
class DeviceRows:
    tokens: torch.Tensor  # [R] int64
    finite: torch.Tensor  # [R] bool
    chosen: torch.Tensor | None = None  # [R] fp32
    top_values: torch.Tensor | None = None  # [R, K] fp32
    top_ids: torch.Tensor | None = None  # [R, K] int64
    failed: Mapping[int, str] = field(default_factory=dict)  # known on the host when the step was launched

    def to_host(self) -> DeviceRows:
        """Pinned host copies, started without waiting (on CPU: these tensors themselves)."""
        if self.tokens.device.type != "cuda":
            return self
        return DeviceRows(*(None if t is None else _pinned_copy(t) for t in
                            (self.tokens, self.finite, self.chosen, self.top_values, self.top_ids)), failed=self.failed)

    def read(self) -> HostRows:
        """As lists (after the copies are done: the caller waits for them first)."""
        lists = [None if t is None else t.tolist() for t in
                 (self.tokens, self.finite, self.chosen, self.top_values, self.top_ids)]
        return HostRows(*lists, failed=self.failed)


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
