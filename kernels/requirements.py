"""What a kernel implementation needs of the engine's configuration, declared on its class (`requirements`) so that
the engine's config checks every registered name the same way instead of knowing each backend's rules."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Requirements:
    cpu_only: bool = False  # runs on CPU tensors only
    min_block_size: int = 1  # the smallest KV block size its kernels handle
    block_size_reason: str = ""  # why, for the error that names block_size

    def __post_init__(self) -> None:
        if self.min_block_size > 1 and not self.block_size_reason:
            raise ValueError("min_block_size needs a block_size_reason (the error a user sees)")
