"""Iteration-level scheduling: token budget, chunked prefill, mixed batches, preemption. Pure Python."""

from __future__ import annotations

from pagedserve.engine.core.block_manager import BlockManager
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.sequence import Sequence, SequenceMetrics, SeqStatus


def seq(n: int, request_id: str) -> Sequence:
    return Sequence(request_id, 0, list(range(1, n + 1)), n, SamplingParams(), SequenceMetrics(0.0))


def run_step(sched: Scheduler, sample: bool = True) -> dict[str, int]:
    out = sched.schedule()
    sched.commit(out)
    if sample:
        for item in out.scheduled:
            if item.seq.num_computed_tokens == item.seq.num_tokens:
                item.seq.token_ids.append(7)
    return {item.seq.request_id: item.num_new_tokens for item in out.scheduled}


def test_long_prompt_is_chunked_and_decodes_join_the_same_step():
    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=10)
    short, long = seq(3, "short"), seq(25, "long")
    sched.add(short)
    sched.add(long)
    assert run_step(sched) == {"short": 3, "long": 7}
    assert run_step(sched) == {"short": 1, "long": 9}  # decode and a prefill chunk share one step
    assert run_step(sched) == {"short": 1, "long": 9}
    assert long.num_computed_tokens == 25 and long.num_output_tokens == 1
    assert run_step(sched) == {"short": 1, "long": 1}


def test_long_prefill_token_threshold_caps_each_sequences_share_of_a_step():
    """vLLM's rule: a prompt computes at most the threshold per step, so the prompts behind it start in the same
    steps; shorter prompts and decodes are untouched."""
    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=40,
                      long_prefill_token_threshold=16)
    long, second, short = seq(50, "long"), seq(20, "second"), seq(5, "short")
    for s in (long, second, short):
        sched.add(s)
    assert run_step(sched) == {"long": 16, "second": 16, "short": 5}
    assert run_step(sched) == {"long": 16, "second": 4, "short": 1}
    assert run_step(sched) == {"long": 16, "second": 1, "short": 1}
    assert run_step(sched) == {"long": 2, "second": 1, "short": 1}
    assert long.num_computed_tokens == 50 and long.num_output_tokens == 1
    unlimited = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=40)
    for s in (seq(50, "long"), seq(20, "second")):
        unlimited.add(s)
    assert run_step(unlimited) == {"long": 40}  # without it the first prompt takes the whole step


def test_max_num_seqs_limits_the_running_batch():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(seq(4, f"r{i}"))
    assert set(run_step(sched)) == {"r0", "r1"}
    sched.finish(sched.running[0])
    assert set(run_step(sched)) == {"r1", "r2"}


def test_kv_pressure_preempts_the_newest_and_it_resumes():
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = seq(7, "old"), seq(3, "new")  # 2 blocks and 1: both start, with a block each to spare
    sched.add(old)
    sched.add(new)
    assert run_step(sched) == {"old": 7, "new": 3}
    for _ in range(5):
        assert run_step(sched) == {"old": 1, "new": 1}  # both grow into the free blocks
    assert bm.num_free_blocks == 1 and (old.num_tokens, new.num_tokens) == (13, 9)
    steps = run_step(sched)  # old takes the last block; new's next one is missing: the newest gives way
    assert steps == {"old": 1}
    assert new.status is SeqStatus.WAITING and new.num_computed_tokens == 0 and new.block_table == []
    assert new.metrics.num_preemptions == 1 and new.num_output_tokens == 6  # its outputs are kept
    sched.finish(old)
    assert run_step(sched) == {"new": 9}  # recompute prompt + outputs in one go
    assert new.num_output_tokens == 7


def test_preempted_sequence_goes_back_to_the_front_of_the_queue():
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = seq(3, "a"), seq(3, "b"), seq(3, "c")
    for s in (a, b, c):
        sched.add(s)
    steps = [run_step(sched) for _ in range(11)]  # all three grow until the pool runs out: c goes, later b
    assert steps[5] == {"a": 1, "b": 1, "c": 1} and steps[6] == {"a": 1, "b": 1} and steps[10] == {"a": 1}
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert sched.num_preemptions == 2


def test_a_prompt_waits_rather_than_take_the_blocks_a_running_sequence_grows_into():
    """Admitted into the last free blocks, it would be the newest sequence when the running one's next block is
    missing: preempted a step or two later and computed again. It waits for a block to spare per sequence."""
    bm = BlockManager(5, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    running, short = seq(7, "running"), seq(8, "short")  # 2 blocks + 2 fit the pool, not a block each beside
    sched.add(running)
    assert run_step(sched) == {"running": 7}
    sched.add(short)
    assert run_step(sched) == {"running": 1}
    assert short.status is SeqStatus.WAITING
    sched.finish(running)
    assert run_step(sched) == {"short": 8}
    roomy = Scheduler(BlockManager(6, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=100)
    running, short = seq(7, "running"), seq(8, "short")
    roomy.add(running)
    run_step(roomy)
    roomy.add(short)
    assert run_step(roomy) == {"running": 1, "short": 8}  # 2 + 2 blocks, one to spare for each: it starts
    assert roomy.num_preemptions == 0


def test_a_long_prompt_waits_until_all_of_it_fits_instead_of_starting_and_being_preempted():
    """Its first chunk fits but the rest does not: started, it would be preempted at its next chunk and its prefill
    computed twice. It waits, nobody is preempted, and it prefills in chunks once the running request ends."""
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8)
    running, long = seq(7, "running"), seq(24, "long")  # 2 blocks, then 6: 8 in all, while running grows
    sched.add(running)
    assert run_step(sched) == {"running": 7}
    sched.add(long)
    for _ in range(3):
        assert run_step(sched) == {"running": 1}  # 6 blocks free: room for long's first chunk, not for all of it
    assert long.status is SeqStatus.WAITING and long.num_computed_tokens == 0
    sched.finish(running)
    assert [run_step(sched) for _ in range(3)] == [{"long": 8}] * 3
    assert sched.num_preemptions == 0 and long.num_output_tokens == 1


def test_a_long_prompt_starts_beside_running_requests_when_it_fits_with_their_growth():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=9)
    running, long = seq(8, "running"), seq(32, "long")  # 2 blocks + 8 blocks + 1 for running's growth: 11 <= 16
    sched.add(running)
    run_step(sched)
    sched.add(long)
    assert run_step(sched) == {"running": 1, "long": 8}
    while long.num_computed_tokens < 32:
        run_step(sched)
    assert sched.num_preemptions == 0


def test_a_preempted_request_resumes_only_when_all_it_recomputes_fits():
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=4)
    old, new = seq(8, "old"), seq(3, "new")
    sched.add(old)
    sched.add(new)
    for _ in range(40):
        run_step(sched)
        if new.metrics.num_preemptions:
            break
    assert new.metrics.num_preemptions == 1 and new.num_tokens > 4  # more than one 4-token chunk to recompute
    computed = []
    while old.status is SeqStatus.RUNNING and len(computed) < 40:
        run_step(sched)
        computed.append(new.num_computed_tokens)
    assert set(computed) == {0}  # never restarted on a chunk beside `old`, so never preempted again
    assert new.metrics.num_preemptions == 1


def test_a_windowed_sequence_outgrows_the_pool_without_preemption():
    """Every layer sliding (window 4): blocks behind the window go back to the pool at each commit, so a sequence
    ten times longer than 4 blocks of 4 tokens runs through without ever waiting."""
    bm = BlockManager(4, 4, window=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=5)
    s = seq(9, "long")
    sched.add(s)
    while s.num_tokens < 160:
        run_step(sched)
        assert bm.num_used_blocks == sum(1 for b in s.block_table if b >= 0) <= 2
    assert sched.num_preemptions == 0 and s.num_computed_tokens == 159


def lora_seq(n: int, request_id: str, adapter: str | None) -> Sequence:
    from pagedserve.engine.lora.config import AdapterInfo

    s = seq(n, request_id)
    if adapter is not None:
        s.adapter = AdapterInfo(adapter, sum(map(ord, adapter)), "/x", 1, ())
    return s


def test_adapter_cap_lets_running_adapters_and_the_base_pass_then_waits():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=16, max_num_batched_tokens=100, max_loras=2,
                      lora_pass_steps=3)
    for request_id, adapter in [("a1", "A"), ("b1", "B"), ("c1", "C"), ("a2", "A"), ("base", None)]:
        sched.add(lora_seq(4, request_id, adapter))
    assert set(run_step(sched)) == {"a1", "b1", "a2", "base"}  # C would be a third adapter: passed
    assert sched.running_adapters() == ("A", "B") and sched.waiting_adapters() == ("C",)
    for step in range(2):  # C is passed in at most lora_pass_steps steps (the first one above included) ...
        sched.add(lora_seq(4, f"a-late{step}", "A"))
        assert f"a-late{step}" in run_step(sched)
    sched.add(lora_seq(4, "a-last", "A"))
    sched.add(lora_seq(4, "base-last", None))
    assert "a-last" not in run_step(sched) and "base-last" not in run_step(sched)  # ... then nobody passes C
    for s in [s for s in sched.running if s.adapter_name == "B"]:
        sched.finish(s)  # B's last request ends: C takes its place, first
    admitted = run_step(sched)
    assert {"c1", "a-last", "base-last"} <= set(admitted)
    assert set(sched.running_adapters()) == {"A", "C"}


def test_every_step_holds_at_most_max_loras_adapters():
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=64, max_loras=2)
    for i in range(24):
        sched.add(lora_seq(3 + i % 5, f"r{i}", "ABCD"[i % 4] if i % 3 else None))
    finished = set()
    while sched.running or sched.waiting:
        out = sched.schedule()
        assert len({item.seq.adapter_id for item in out.scheduled if item.seq.adapter is not None}) <= 2
        sched.commit(out)
        for item in out.scheduled:
            if item.seq.num_computed_tokens == item.seq.num_tokens:
                item.seq.token_ids.append(7)
                if item.seq.num_output_tokens == 3:
                    finished.add(item.seq.request_id)
                    sched.finish(item.seq)
    assert len(finished) == 24
