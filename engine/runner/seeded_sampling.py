"""Seeded sampling: each sample of a seeded request draws from its own stream of the seed, on the device its
probabilities are on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.core.seq_features import SeqFeature
from pagedserve.engine.core.sequence import Sequence


def _stream_seed(seed: int, index: int) -> int:
    return (seed + 0x9E3779B97F4A7C15 * index) % 2**63


def generator_for(seed: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(_stream_seed(seed, index))
    return g


@dataclass(slots=True)
class SeededSampling(SeqFeature):
    """A seeded request's per-sample generator: sample `index` draws from its own stream of the seed. Logits on a
    GPU draw from a generator of that device, made from the same stream's seed on first use (a CPU generator cannot
    drive a CUDA multinomial)."""

    seed: int
    generator: torch.Generator
    index: int = 0
    device_generator: torch.Generator | None = None

    @classmethod
    def start(cls, seed: int) -> SeededSampling:
        return cls(seed, generator_for(seed, 0))

    def fork(self, index: int) -> SeededSampling:
        return SeededSampling(self.seed, generator_for(self.seed, index), index)

    def on(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.generator
        if self.device_generator is None or self.device_generator.device != device:
            self.device_generator = generator_for(self.seed, self.index, device)
        return self.device_generator


def generator_of(seq: Sequence, device: torch.device = torch.device("cpu")) -> torch.Generator | None:
    """The sequence's own generator on `device` (where the probabilities it samples from are), or None (that
    device's default generator) when its request has no seed."""
    state = seq.features.get(SeededSampling)
    return None if state is None else state.on(device)
