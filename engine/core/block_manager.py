"""Paged KV block bookkeeping: block tables, ref counts, prefix caching, copy-on-write. Pure Python.

A block is free when no sequence references it. Free blocks that hold a committed full block of tokens stay
findable by their hash (prefix caching) until they are reused; reuse order is least recently freed first.

Sliding windows: when every layer of the model attends over at most `window` positions, a block wholly before the
window of a sequence's next token can never be read again. `release_out_of_window` frees it and leaves `FREED` in
its block-table slot (positions still map to slots by index). It is freed only after `commit_full_blocks` hashed
it, so the prefix cache keeps it findable like any freed block, with contents still valid until reuse evicts it;
and a prefix hit needs only the blocks its first uncached token can see, so one whose head was evicted still hits.
Forks, frees and preemption skip FREED entries.
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from dataclasses import dataclass

from pagedserve.engine.kv_events import BlockRemoved, BlockStored, KvEvent
from pagedserve.engine.core.sequence import Sequence

FREED = -1  # a block-table entry whose block fell out of every window and went back to the pool


class BlockAccountingError(RuntimeError):
    """An internal invariant broke (a double free, a negative ref count). Never a client mistake."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PrefixHit:
    block_ids: tuple[int, ...]
    hashes: tuple[int, ...]


def chain_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    # Tuples of ints hash deterministically in CPython (no per-process salt), so this is stable and cheap.
    return hash((prev, tokens))


def chain_root(seq: Sequence, long_rope_after: int | None = None) -> int | None:
    """What a sequence's first block chains from: None for the base, a key of its adapter otherwise, so a block
    computed under one adapter is never found for another or for the base. With LongRoPE (`long_rope_after`: the
    length past which a sequence's keys use the long factors) a long sequence's blocks chain apart from short ones'."""
    root = None if seq.adapter_id == 0 else hash(("lora", seq.adapter_id))
    if seq.cache_salt is not None:  # a salted request's blocks chain apart from everyone else's
        root = hash(("salt", seq.cache_salt, root))
    if long_rope_after is not None and seq.num_tokens > long_rope_after:
        root = hash(("long-rope", root))
    return root


def _new_blocks(count: int) -> list[Block]:
    """With the cyclic collector paused (blocks hold only ints and tuples): the collections 131k new objects set off
    walk every object of a process holding torch and a model, 0.5 s of a default pool's 0.6 s to build."""
    paused = gc.isenabled()
    gc.disable()
    try:
        return list(map(Block, range(count)))
    finally:
        if paused:
            gc.enable()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int | None = None
    ):
        if window is not None and window < 1:
            raise ValueError(f"window must be None or >= 1, got {window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.long_rope_after: int | None = None  # LongRoPE models: set by the engine (see chain_root)
        self.window = window  # the widest sliding window when every layer has one; None: blocks live to the end
        self.blocks = _new_blocks(num_blocks)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block id
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self._events: list[KvEvent] | None = None  # None: nobody listens, record nothing

    def record_events(self) -> None:
        """Start recording prefix-cache events; a listener must then drain them with take_events()."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events or [], [] if self._events is not None else None
        return events

    @property
    def cached_hashes(self) -> frozenset[int]:
        return frozenset(self._cached)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def peak_blocks(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks one sequence of `num_tokens` ever holds at once, computing <= max_step_tokens per step.

        With a window, a step over tokens n..n+k-1 needs only positions n - window + 1 .. n + k - 1 (the rest is
        released after each commit), so a sequence longer than the whole cache still fits.
        """
        if self.window is None:
            return self.blocks_needed(num_tokens)
        span = self.window - 1 + max_step_tokens
        return min(self.blocks_needed(num_tokens), -(-span // self.block_size) + 1)

    # -- prefix caching -------------------------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> PrefixHit:
        """Cached full blocks at the start of `seq`; at least one token is always left to compute.

        With a window, only the blocks the first uncached token can see must still be cached: the hit is the longest
        prefix whose last blocks (from its window's start on) are all present; blocks before that may be gone (FREED).
        """
        if not self.enable_prefix_caching:
            return PrefixHit((), ())
        ids: list[int] = []
        hashes: list[int] = []
        # run: consecutive cached blocks ending at block i
        prev, run, best = chain_root(seq, self.long_rope_after), 0, 0
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            prev = chain_hash(prev, tokens)
            block_id = self._cached.get(prev)
            cached = block_id is not None and self.blocks[block_id].tokens == tokens
            if not cached and self.window is None:
                break
            ids.append(block_id if cached else FREED)
            hashes.append(prev)
            run = run + 1 if cached else 0
            if cached and run >= i + 1 - self._dead_blocks((i + 1) * self.block_size):
                best = i + 1
        return PrefixHit(tuple(ids[:best]), tuple(hashes[:best]))

    def record_lookup(self, seq: Sequence, hit: PrefixHit) -> None:
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(hit.block_ids) * self.block_size

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Make the sequence's computed full blocks findable by later requests."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= len(seq.block_hashes):
            return  # no block filled since the last call: most decode steps
        prev = seq.block_hashes[-1] if seq.block_hashes else chain_root(seq, self.long_rope_after)
        for i in range(len(seq.block_hashes), full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(prev, tokens)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self._cached:
                block.hash, block.tokens = h, tokens
                self._cached[h] = block.block_id
                if self._events is not None:
                    parent = prev if i > 0 else None  # a first block's parent is no block, adapter or not
                    lora = (seq.adapter_id, seq.adapter_name) if seq.adapter is not None else (None, None)
                    self._events.append(BlockStored(h, parent, tokens, self.block_size, *lora))
            seq.block_hashes.append(h)
            prev = h

    def reset_prefix_cache(self) -> int:
        """Makes every cached block unfindable (blocks in use stay with their sequences); returns how many."""
        for block_hash, block_id in self._cached.items():
            block = self.blocks[block_id]
            block.hash, block.tokens = None, ()
            if self._events is not None:
                self._events.append(BlockRemoved(block_hash))
        count, self._cached = len(self._cached), {}
        return count

    # -- allocation -----------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None,
                     spare_blocks: int = 0) -> bool:
        """Whether `seq` can take blocks for `num_new_tokens` more tokens and leave `spare_blocks` free."""
        return self._blocks_to_take(seq, num_new_tokens, hit) + spare_blocks <= len(self._free)

    def blocks_to_take(self, seq: Sequence, num_new_tokens: int) -> int:
        """The free blocks `seq` takes for `num_new_tokens` more tokens (fresh ones and a copy-on-write)."""
        return self._blocks_to_take(seq, num_new_tokens, None)

    def _blocks_to_take(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None) -> int:
        hit_ids = hit.block_ids if hit else ()
        held = len(seq.block_table) + len(hit_ids)
        computed = seq.num_computed_tokens + len(hit_ids) * self.block_size
        fresh = max(0, self.blocks_needed(computed + num_new_tokens) - held)
        if hit_ids:  # only an admission's prefix hit: the running sequences' checks (twice a step each) skip this
            dead = self._dead_blocks(computed)  # hit blocks already out of the window are not taken at all
            fresh += sum(1 for b in hit_ids[dead:] if self.blocks[b].ref_count == 0)
        return fresh + (1 if self._needs_copy_on_write(seq) else 0)

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> list[tuple[int, int]]:
        """Give `seq` blocks for its next `num_new_tokens` tokens; returns (src, dst) block copies to perform."""
        if not self.can_allocate(seq, num_new_tokens, hit):
            raise BlockAccountingError("allocate called without room; the scheduler must check can_allocate")
        if hit and hit.block_ids:
            assert not seq.block_table, "prefix hits are looked up for sequences that hold no blocks yet"
            seq.num_computed_tokens += len(hit.block_ids) * self.block_size
            dead = self._dead_blocks(seq.num_computed_tokens)
            seq.block_table.extend(FREED if i < dead else self._take(b) for i, b in enumerate(hit.block_ids))
            seq.block_hashes.extend(hit.hashes)
        copies = self._copy_on_write(seq)
        missing = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if missing > 0:  # most decode steps take none
            # The same blocks (the least recently freed), in address order: the free list hands a finished
            # sequence's blocks back tail first, and decode attention reads an 8-bit cache's tiles 9-18% slower in
            # descending order than in ascending (the hardware prefetcher runs ahead, not back; bf16 0-3%).
            seq.block_table.extend(sorted(self._take(self._pop_free()) for _ in range(missing)))
        return copies

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        offset = seq.num_computed_tokens % self.block_size
        index = seq.num_computed_tokens // self.block_size
        return offset != 0 and index < len(seq.block_table) and self.blocks[seq.block_table[index]].ref_count > 1

    def _copy_on_write(self, seq: Sequence) -> list[tuple[int, int]]:
        """The partially filled last block is about to be written; a shared one must be copied first."""
        if not self._needs_copy_on_write(seq):
            return []
        index = seq.num_computed_tokens // self.block_size
        src = seq.block_table[index]
        dst = self._take(self._pop_free())
        self._release(src)
        seq.block_table[index] = dst
        return [(src, dst)]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for block_id in parent.block_table:
            if block_id != FREED:
                self._take(block_id)
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so the reusable prefix heads are the last to be evicted.
        for block_id in reversed(seq.block_table):
            if block_id != FREED:
                self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []

    def trim_to_computed(self, seq: Sequence) -> int:
        """Release the blocks past the sequence's computed tokens (taken for speculative positions that were rejected;
        never hashed, since only computed full blocks are); returns how many."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        extra = seq.block_table[keep:]
        for block_id in reversed(extra):
            self._release(block_id)
        del seq.block_table[keep:]
        return len(extra)

    def release_out_of_window(self, seq: Sequence) -> int:
        """Free the blocks no later token of `seq` can see (call after commit_full_blocks); returns how many."""
        dead = min(self._dead_blocks(seq.num_computed_tokens), len(seq.block_table))
        released = 0
        for index in range(dead - 1, -1, -1):  # newest first: the older ones went in earlier calls
            if seq.block_table[index] == FREED:
                break
            self._release(seq.block_table[index])
            seq.block_table[index] = FREED
            released += 1
        return released

    # -- internals ------------------------------------------------------------------------------------
    def _dead_blocks(self, num_computed: int) -> int:
        """Leading blocks no token at or after position `num_computed` can see (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its prefix-cache entry: its contents are about to change
            if self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
                if self._events is not None:
                    self._events.append(BlockRemoved(block.hash))
            block.hash, block.tokens = None, ()
        self._free[block_id] = None  # _take removes it again; keeps one code path for both callers
        return block_id

    def _take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise BlockAccountingError(f"block {block_id} released with ref_count {block.ref_count}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
