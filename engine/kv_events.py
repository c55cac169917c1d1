"""KV-cache events: what entered and left the prefix cache, in the order it happened.

A router that applies these to an empty set holds exactly the block hashes this engine can serve from cache, so
it can send a request to the replica that already holds its prefix (vLLM's BlockStored / BlockRemoved).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block became findable in the prefix cache under `block_hash` (its chain key)."""

    block_hash: int
    parent_hash: int | None  # the chain key of the block before it; None for a prompt's first block
    token_ids: tuple[int, ...]
    block_size: int
    # The LoRA adapter the block was computed under (None: the base); its id is folded into the chain key of a
    # sequence's first block, so the same tokens under another adapter are other blocks (router proto: lora_id,
    # lora_name).
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The block cached under `block_hash` was evicted (reused for other tokens); the cache no longer holds it."""

    block_hash: int


KvEvent = BlockStored | BlockRemoved
