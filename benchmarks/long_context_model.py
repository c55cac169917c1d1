"""The long-context benchmark's tokens/s ratio predicted for workloads not run: the engine's Scheduler and
BlockManager replay a workload step by step (exact: admission_replay.py's replay_steps) for each cache dtype's block
count, and each step is priced with costs measured by kv_long_context_profile.py: a fixed cost per step and one per
decode row (the weights' read and the linears' arithmetic, the same for every cache), and per dtype, prefill per
token and decode attention per cached key of every decode row. Prints, per workload seed, the predicted
tokens/s of each dtype and its ratio to the first, then the worst, median and best ratio over the seeds.

What it is for: the measured ratio is one workload (one seed's prompt lengths and order) on one host at one moment;
this shows how much of it is the workload's shape (how long the 8-bit cache runs a request alone, how often the
16-bit one preempts) and so which seeds are the hard ones to measure. The costs default to the quiet profile in
docs/kv-cache-formats.md ("Where the 128 MiB run's time goes"); pass the ones of a new profile to re-price.

    python benchmarks/long_context_model.py --blocks 364 706 --requests 4 --shortest 2048 --longest 4096 \
        --output-tokens 1024 --seeds 0 1 2 3 4 5 6 7 8 9

`--admission reserve` prices the same workloads under an admission rule the engine does not have (SGLang's, on top
of the engine's rule before it kept one block per running sequence): a prompt starts only if the free blocks also
hold a share of every running request's remaining `max_tokens` and of its own, the share starting at 0.7 and
decaying to 0.1 over 600 steps, and set after a preemption to the fraction of their `max_tokens` the running
requests have produced. `--early-stop F` makes each request end (an end-of-sequence
token) after `max_tokens * u^2` outputs, u uniform in [F, 1] per request and seed, where such a reserve is too much.
`--admission whole-prompt` is the engine's rule before it kept one block per running sequence (and one for the new
one) free past the prompt.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
from admission_replay import BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS, WholePromptScheduler, replay_steps  # noqa: E402
from kv_long_context import workload  # noqa: E402
from pagedserve.engine.core.block_manager import BlockManager  # noqa: E402
from pagedserve.engine.core.scheduler import Scheduler  # noqa: E402


class ReserveScheduler(WholePromptScheduler):
    """SGLang's admission (its `new_token_ratio`): room kept for a share of the running requests' remaining outputs."""

    FIRST, LAST, DECAY_STEPS, RETRACT_STEPS = 0.7, 0.1, 600, 20

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.share = self.FIRST

    def schedule(self):
        preemptions = self.num_preemptions
        out = super().schedule()
        if self.num_preemptions > preemptions:
            produced = sum(s.num_output_tokens + self.RETRACT_STEPS for s in self.running)
            self.share = min(1.0, produced / max(1, sum(s.params.max_tokens for s in self.running)))
        else:
            self.share = max(self.LAST, self.share - (self.FIRST - self.LAST) / self.DECAY_STEPS)
        return out

    def _prefill_can_finish(self, seq, num_new, uncomputed, hit) -> bool:
        remaining = sum(s.params.max_tokens - s.num_output_tokens for s in (*self.running, seq))
        spare = self.block_manager.blocks_needed(int(remaining * self.share))
        return super()._prefill_can_finish(seq, num_new, uncomputed, hit) and \
            self.block_manager.can_allocate(seq, uncomputed, hit, spare_blocks=spare)


ADMISSION = {"engine": Scheduler, "whole-prompt": WholePromptScheduler, "reserve": ReserveScheduler}


def draw_stops(requests: int, output_tokens: int, early_stop: float | None, seed: int) -> list[int]:
    """Where each request ends: `output_tokens` each, or with `early_stop` F after `output_tokens * u^2` outputs, u
    uniform in [F, 1] (drawn from seed + 100, apart from the prompts' own draw)."""
    if early_stop is None:
        return [output_tokens] * requests
    rng = random.Random(seed + 100)
    return [max(1, int(output_tokens * rng.uniform(early_stop, 1.0) ** 2)) for _ in range(requests)]


def predicted_seconds(blocks: int, prompts: list[list[int]], output_tokens: int, step_ms: float, row_ms: float,
                      prefill_ms_per_token: float, attention_us_per_key: float,
                      admission: type[Scheduler] = Scheduler, stops: list[int] | None = None) -> float:
    """The workload's time on `blocks` blocks: every step's fixed cost, its prefill tokens, its decode rows and
    their keys (context length including the new token), priced as given."""
    sched = admission(BlockManager(blocks, BLOCK_SIZE), 256, MAX_NUM_BATCHED_TOKENS)
    ms = 0.0
    for out in replay_steps(sched, prompts, output_tokens, stops):
        ms += step_ms
        for item in out.scheduled:
            if item.num_new_tokens > 1:
                ms += prefill_ms_per_token * item.num_new_tokens
            else:
                ms += row_ms + attention_us_per_key * 1e-3 * item.seq.num_tokens
    return ms / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[364, 706],
                        help="per dtype, the block count its cache gets from the budget (first: the reference)")
    # The quiet profile's "rest of the step" was 4.8 ms at 1.17 decode rows (bf16) and 5.3 at 2.00 (int8): a fixed
    # 4.1 ms and 0.6 ms per row, which "Inside a decode step" finds in the linears' arithmetic.
    parser.add_argument("--step-ms", type=float, default=4.1, help="a step's cost besides its rows and prefill")
    parser.add_argument("--row-ms", type=float, default=0.6, help="a decode row's cost besides its attention")
    parser.add_argument("--prefill-ms-per-token", type=float, nargs="+", default=[0.322, 0.317])
    parser.add_argument("--attention-us-per-key", type=float, nargs="+", default=[5.3e3 / 3585, 3.4e3 / 3585],
                        help="per dtype, decode attention per cached key of a row over all layers")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--shortest", type=int, default=2048)
    parser.add_argument("--longest", type=int, default=4096)
    parser.add_argument("--output-tokens", type=int, default=1024)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--admission", choices=sorted(ADMISSION), default="engine",
                        help="engine: the engine's Scheduler; whole-prompt, reserve: the rules above")
    parser.add_argument("--early-stop", type=float, help="requests end after max_tokens * u^2, u in [F, 1]")
    args = parser.parse_args()
    costs = list(zip(args.blocks, args.prefill_ms_per_token, args.attention_us_per_key, strict=True))
    ratios = {blocks: [] for blocks in args.blocks[1:]}
    for seed in args.seeds:
        prompts = workload(args.requests, args.shortest, args.longest, seed)
        stops = draw_stops(len(prompts), args.output_tokens, args.early_stop, seed)
        tokens = sum(map(len, prompts)) + sum(stops)
        rates = [tokens / predicted_seconds(b, prompts, args.output_tokens, args.step_ms, args.row_ms, p, a,
                                            ADMISSION[args.admission], stops)
                 for b, p, a in costs]
        for blocks, rate in zip(args.blocks[1:], rates[1:]):
            ratios[blocks].append(rate / rates[0])
        print(json.dumps({"seed": seed, "prompts": [len(p) for p in prompts],
                          "tokens_per_s": dict(zip(map(str, args.blocks), map(lambda r: round(r, 1), rates))),
                          "vs_first": [round(rate / rates[0], 3) for rate in rates[1:]]}))
    for blocks, values in ratios.items():
        print(json.dumps({"blocks": blocks, "vs_first_worst": round(min(values), 3),
                          "vs_first_median": round(statistics.median(values), 3),
                          "vs_first_best": round(max(values), 3)}))


if __name__ == "__main__":
    main()
