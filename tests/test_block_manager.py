"""The paged block manager on its own: pure Python, no model."""

from __future__ import annotations

import pytest

from pagedserve.engine.core.block_manager import FREED, BlockAccountingError, BlockManager
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.core.sequence import Sequence, SequenceMetrics


def seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, 0, list(tokens), len(tokens), SamplingParams(), SequenceMetrics(0.0))


def compute(bm: BlockManager, s: Sequence, n: int, hit=None):
    copies = bm.allocate(s, n, hit)
    s.num_computed_tokens += n
    bm.commit_full_blocks(s)
    return copies


def refcounts(bm: BlockManager) -> dict[int, int]:
    return {b.block_id: b.ref_count for b in bm.blocks if b.ref_count}


def test_blocks_are_allocated_on_demand_and_freed():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(10)))
    compute(bm, s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    s.token_ids.append(99)
    compute(bm, s, 1)
    assert len(s.block_table) == 3  # token 11 still fits in block 3
    s.token_ids += [1, 2]
    compute(bm, s, 2)
    assert len(s.block_table) == 4
    bm.free(s)
    assert bm.num_free_blocks == 8 and not refcounts(bm)


def test_reused_blocks_are_handed_out_in_address_order():
    # A freed sequence's blocks go back tail first; the next one to take them all gets the same blocks, ascending.
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(16)), "a")
    compute(bm, a, 16)
    assert a.block_table == [0, 1, 2, 3]
    bm.free(a)
    b = seq(list(range(100, 116)), "b")
    compute(bm, b, 16)
    assert b.block_table == [0, 1, 2, 3] and not bm.lookup_prefix(seq(list(range(16)))).block_ids


def test_prefix_blocks_are_shared_by_hash_chain():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(13)), "a")
    compute(bm, a, 13)
    b = seq(list(range(12)) + [77, 78], "b")
    hit = bm.lookup_prefix(b)
    assert hit.block_ids == tuple(a.block_table[:3])
    compute(bm, b, b.num_tokens - 12, hit)
    assert b.num_computed_tokens == 14 and b.block_table[:3] == a.block_table[:3]
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:3])
    # Same tokens in the second block but a different first block: the chain must not match.
    c = seq([5, 5, 5, 5] + list(range(4, 12)) + [1], "c")
    assert bm.lookup_prefix(c).block_ids == ()


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(8)))
    compute(bm, a, 8)
    b = seq(list(range(8)))
    assert len(bm.lookup_prefix(b).block_ids) == 1  # (8 - 1) // 4 full blocks may be reused


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    compute(bm, a, 5)
    bm.free(a)
    assert bm.num_free_blocks == 4
    again = seq([1, 2, 3, 4, 9])
    hit = bm.lookup_prefix(again)
    assert len(hit.block_ids) == 2  # still cached although free
    assert bm.can_allocate(again, 1, hit)
    compute(bm, again, 1, hit)
    bm.free(again)
    # Filling the cache with other tokens evicts the old entries only when free blocks run out.
    other = seq([7] * 8)
    compute(bm, other, 8)
    assert bm.lookup_prefix(seq([1, 2, 3, 4, 5])).block_ids == ()


def test_fork_shares_blocks_and_copy_on_write_splits_the_last_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(list(range(6)))
    compute(bm, parent, 6)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert all(bm.blocks[i].ref_count == 2 for i in parent.block_table)
    child.token_ids.append(50)
    copies = compute(bm, child, 1)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    parent.token_ids.append(60)
    assert compute(bm, parent, 1) == []  # the parent is now the only owner: writes in place
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8 and not refcounts(bm)


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq([1, 2, 3])
    compute(bm, s, 3)
    table = list(s.block_table)
    bm.free(s)
    s.block_table = table
    with pytest.raises(BlockAccountingError):
        bm.free(s)


def test_cannot_allocate_beyond_the_pool():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(list(range(9)))
    assert not bm.can_allocate(s, 9)
    with pytest.raises(BlockAccountingError):
        bm.allocate(s, 9)
    assert bm.num_free_blocks == 2


# -- sliding windows: blocks behind every layer's window go back to the pool -----------------------------------
def compute_windowed(bm: BlockManager, s: Sequence, n: int, hit=None):
    """What Scheduler.commit does: advance, publish full blocks, then release the ones behind the window."""
    copies = compute(bm, s, n, hit)
    bm.release_out_of_window(s)
    return copies


def live(s: Sequence) -> list[int]:
    return [b for b in s.block_table if b != FREED]


def test_blocks_behind_the_window_are_freed_as_a_sequence_grows():
    bm = BlockManager(num_blocks=16, block_size=4, window=6)
    s = seq(list(range(10)))
    compute_windowed(bm, s, 10)  # token 10 sees 5..10: block 0 (0..3) is dead
    assert s.block_table[0] == FREED and len(s.block_table) == 3
    assert refcounts(bm) == {b: 1 for b in live(s)}
    for token in range(40):
        s.token_ids.append(token)
        compute_windowed(bm, s, 1)
        assert len(live(s)) <= -(-6 // 4) + 1  # ceil(window / block) + 1, whatever the alignment
        assert bm.num_free_blocks == 16 - len(live(s))
    assert len(s.block_table) == 13 and s.block_table[:11] == [FREED] * 11
    bm.free(s)  # FREED entries are skipped: no double release
    assert bm.num_free_blocks == 16 and not refcounts(bm)


def test_without_a_window_nothing_is_released():
    bm = BlockManager(num_blocks=16, block_size=4)
    s = seq(list(range(30)))
    compute(bm, s, 30)
    assert bm.release_out_of_window(s) == 0 and FREED not in s.block_table


def test_freed_blocks_stay_in_the_prefix_cache_and_a_hit_needs_only_the_window():
    bm = BlockManager(num_blocks=16, block_size=4, window=6)
    a = seq(list(range(21)), "a")
    compute_windowed(bm, a, 21)  # blocks 0..4 were published, then 0..3 freed (token 21 sees 16..21)
    assert a.block_table[:4] == [FREED] * 4
    b = seq(list(range(20)) + [99, 98], "b")
    hit = bm.lookup_prefix(b)
    assert len(hit.block_ids) == 5  # all five full blocks are cached, the freed ones included
    compute_windowed(bm, b, b.num_tokens - 20, hit)
    # Hit blocks behind token 20's window were never taken; b now shares the block token 22 still sees with a.
    assert b.block_table[:4] == [FREED] * 4 and b.block_table[4] == a.block_table[4]
    assert bm.blocks[a.block_table[4]].ref_count == 2
    # 12 more blocks reuse the free pool from its least recently freed end: the chain's first three blocks go.
    compute(bm, seq([7] * 48, "filler"), 48)
    c = seq(list(range(20)) + [5], "c")
    assert bm.lookup_prefix(c).block_ids[:3] == (FREED,) * 3
    assert len(bm.lookup_prefix(c).block_ids) == 5  # token 20 sees only blocks 3 and 4, both still cached


def test_a_gap_inside_the_window_shortens_the_hit():
    bm = BlockManager(num_blocks=16, block_size=4, window=6)
    a = seq(list(range(21)), "a")
    compute_windowed(bm, a, 21)
    bm.free(a)
    compute(bm, seq([7] * 44, "filler"), 44)  # 11 blocks: the pool's fresh ones, then a's block 3 (freed first)
    hit = bm.lookup_prefix(seq(list(range(20)) + [5], "c"))
    # Token 20 would need blocks 3 and 4; block 3 is gone, so the hit ends after block 2 (token 12 sees 7..12).
    assert len(hit.block_ids) == 3 and FREED not in hit.block_ids


def test_preempted_windowed_sequence_recomputes_from_its_cached_window():
    bm = BlockManager(num_blocks=16, block_size=4, window=6)
    s = seq(list(range(26)))
    compute_windowed(bm, s, 26)
    bm.free(s)  # preemption: every live block released, FREED entries skipped
    s.num_computed_tokens = 0
    assert bm.num_free_blocks == 16 and not refcounts(bm)
    hit = bm.lookup_prefix(s)
    assert len(hit.block_ids) == 6  # resumes at token 24, not from scratch
    compute_windowed(bm, s, 2, hit)
    assert s.num_computed_tokens == 26 and len(live(s)) <= 3


def test_fork_of_a_windowed_sequence_shares_only_live_blocks():
    bm = BlockManager(num_blocks=16, block_size=4, window=6)
    parent = seq(list(range(18)))
    compute_windowed(bm, parent, 18)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and FREED in child.block_table
    assert all(bm.blocks[b].ref_count == 2 for b in live(parent))
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 16 and not refcounts(bm)


def test_peak_blocks_of_a_windowed_sequence_are_bounded_by_the_window_and_the_step():
    assert BlockManager(16, 4).peak_blocks(100, 5) == 25
    windowed = BlockManager(16, 4, window=6)
    assert windowed.peak_blocks(100, 5) == 4  # positions n - 5 .. n + 4: 10 of them, over at most 4 blocks
    assert windowed.peak_blocks(7, 5) == 2  # a short sequence never needs more than its own blocks
    # The bound holds in practice: a 100-token sequence in 5-token steps never holds more.
    s = seq(list(range(9)))
    peak = 0
    while s.num_tokens < 100:
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(1)  # the prompt is done: one sampled token per step
        n = min(5, s.num_tokens - s.num_computed_tokens)
        windowed.allocate(s, n)
        peak = max(peak, sum(1 for b in s.block_table if b != FREED))
        s.num_computed_tokens += n
        windowed.commit_full_blocks(s)
        windowed.release_out_of_window(s)
    assert peak <= 4
