"""Preemptions and recomputed prompt tokens of the long-context workloads, from the scheduler alone (no model): the
engine's Scheduler and BlockManager run the same requests step by step with every scheduled token counted as
computed, so the figures are exact and take seconds. Each row compares the admission rule the scheduler has (a
prompt starts only when all of it fits with one block to spare for every running sequence and for it, and a prompt
longer than one step's chunk also with the running sequences' growth meanwhile) with the rule it had before
(`whole_prompt`: the same without the one block each) and with vLLM v1's check of the first chunk alone, per block
count (the counts the 16-bit, int8 and FP8 caches get from the budget) and per workload seed.

    python benchmarks/admission_replay.py --blocks 364 706 728 --requests 4 --shortest 2048 --longest 4096 \
        --output-tokens 1024 --seeds 0 1 2 3 4 5 6 7 8 9
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
from kv_long_context import workload  # noqa: E402
from pagedserve.engine.core.block_manager import BlockManager  # noqa: E402
from pagedserve.engine.core.scheduler import Scheduler  # noqa: E402
from pagedserve.engine.core.scheduler_output import SchedulerOutput  # noqa: E402
from pagedserve.engine.core.sequence import Sequence, SequenceMetrics, SeqStatus  # noqa: E402
from pagedserve.engine.sampling_params import SamplingParams  # noqa: E402

MAX_NUM_BATCHED_TOKENS = 2048  # EngineConfig's default, which kv_long_context.py runs with
BLOCK_SIZE = 16


class FirstChunkScheduler(Scheduler):
    """vLLM v1's admission: a waiting prompt starts whenever its next chunk's blocks are free."""

    def _prefill_can_finish(self, *args) -> bool:
        return True


class WholePromptScheduler(Scheduler):
    """The engine's admission before it kept a block per running sequence: a prompt longer than one step's chunk
    starts when all of it and the running sequences' growth during its chunks fit; a shorter one whenever it fits
    (the engine's own check with no headroom: a one-chunk prompt's blocks were already found free)."""

    HEADROOM_BLOCKS = 0


def replay_steps(sched: Scheduler, prompts: list[list[int]], output_tokens: int,
                 stops: list[int] | None = None) -> Iterator[SchedulerOutput]:
    """Runs the prompts through `sched` to the end with every scheduled token counted as computed (no model): yields
    each step's output once committed, before its rows that reached their end take the next token (a decode row's
    `seq.num_tokens` is then its context, the new token included). Every request asks for `output_tokens`
    (max_tokens); `stops`, if given, is where each one actually ends (an end-of-sequence token before its limit)."""
    seqs = [Sequence(f"r{i}", 0, list(p), len(p), SamplingParams(max_tokens=output_tokens), SequenceMetrics(0.0))
            for i, p in enumerate(prompts)]
    ends = {seq: stop for seq, stop in zip(seqs, stops or [output_tokens] * len(seqs), strict=True)}
    for seq in seqs:
        sched.add(seq)
    while any(seq.status is not SeqStatus.FINISHED for seq in seqs):
        out = sched.schedule()
        if out.is_empty:
            raise RuntimeError(f"nothing schedulable with {sched.block_manager.num_blocks} blocks: a request cannot "
                               "fit the cache")
        sched.commit(out)
        yield out
        for item in out.scheduled:
            seq = item.seq
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(200)
                if seq.num_tokens - seq.num_prompt_tokens >= ends[seq]:
                    sched.finish(seq)


def replay(scheduler_type: type[Scheduler], blocks: int, prompts: list[list[int]], output_tokens: int) -> dict:
    sched = scheduler_type(BlockManager(blocks, BLOCK_SIZE), 256, MAX_NUM_BATCHED_TOKENS)
    steps = computed = 0
    for out in replay_steps(sched, prompts, output_tokens):
        steps += 1
        computed += sum(item.num_new_tokens for item in out.scheduled)
    # every request computes its prompt and all but its last output token once; the rest was computed again
    once = sum(len(p) + output_tokens - 1 for p in prompts)
    return {"steps": steps, "preemptions": sched.num_preemptions, "recomputed_tokens": computed - once}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[364, 706, 728])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--shortest", type=int, default=2048)
    parser.add_argument("--longest", type=int, default=4096)
    parser.add_argument("--output-tokens", type=int, default=1024)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    for seed in args.seeds:
        prompts = workload(args.requests, args.shortest, args.longest, seed)
        for blocks in args.blocks:
            if max(map(len, prompts)) + args.output_tokens > blocks * BLOCK_SIZE:
                continue  # the engine refuses such a request (CapacityError)
            row = {"seed": seed, "blocks": blocks, "prompts": [len(p) for p in prompts]}
            for name, kind in (("engine", Scheduler), ("whole_prompt", WholePromptScheduler),
                               ("first_chunk", FirstChunkScheduler)):
                row[name] = replay(kind, blocks, prompts, args.output_tokens)
            print(json.dumps(row))


if __name__ == "__main__":
    main()
