"""The engine's admission rule against the one it had before, end to end on the default model: many short requests
that stop early in a small KV budget, where a prompt admitted into the last free blocks is preempted a few steps
later by a running sequence's next block and computed again. The engine keeps one free block per running sequence
(and one for the new prompt) past every prompt it admits; `whole_prompt` (admission_replay.py's
WholePromptScheduler: no headroom, set on the engine's scheduler for its run) is the rule before that.

Each request ends after its drawn length (`--early-stop F`: `output_tokens * u^2`, u uniform in [F, 1], drawn as
long_context_model.py draws them, so its replay prices the same workload): `max_tokens` is that length with
`ignore_eos`, which neither rule reads, so it is the same as an end-of-sequence token or an abort there. Per cache
dtype and round the two rules run back to back (the order alternating round by round), each in a fresh engine on
the same prompts; per run: seconds, tokens/s, preemptions and steps, beside the replay's preemptions for the same
workload and rule (the scheduler alone, no model: they agree exactly when the engine schedules as the replay does).

    python benchmarks/admission_ab.py --kv-cache-memory 64MiB --kv bf16 int8 --requests 64 --shortest 100 \
        --longest 400 --output-tokens 512 --early-stop 0.1 --rounds 2 --json admission-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
from admission_replay import WholePromptScheduler, replay_steps  # noqa: E402
from fp8_kv_accuracy import host_info  # noqa: E402
from kv_long_context import read_gbs, workload  # noqa: E402
from long_context_model import draw_stops  # noqa: E402
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedserve.engine.core.block_manager import BlockManager  # noqa: E402
from pagedserve.engine.core.scheduler import Scheduler  # noqa: E402
from pagedserve.service.cli import parse_bytes  # noqa: E402

RULES = {"engine": Scheduler, "whole_prompt": WholePromptScheduler}


def replayed_preemptions(rule: str, blocks: int, block_size: int, max_num_batched_tokens: int,
                         prompts: list[list[int]], output_tokens: int, stops: list[int]) -> int:
    sched = RULES[rule](BlockManager(blocks, block_size), 256, max_num_batched_tokens)
    for _ in replay_steps(sched, prompts, output_tokens, stops):
        pass
    return sched.num_preemptions


def run(rule: str, kv: str, memory: int, prompts: list[list[int]], stops: list[int]) -> dict:
    engine = LLMEngine(EngineConfig(kv_cache_dtype=kv, kv_cache_memory=memory))
    engine.scheduler.HEADROOM_BLOCKS = RULES[rule].HEADROOM_BLOCKS  # the rule, on the engine's own scheduler
    t0 = time.perf_counter()
    for n, (prompt, stop) in enumerate(zip(prompts, stops, strict=True)):
        engine.add_request(f"r{n}", prompt, SamplingParams(temperature=0.0, max_tokens=stop, ignore_eos=True))
    steps = peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, engine.stats().num_running)
    seconds = time.perf_counter() - t0
    stats = engine.stats()
    tokens = sum(map(len, prompts)) + sum(stops)
    return {"rule": rule, "kv_cache_dtype": stats.kv_cache_dtype, "blocks": stats.num_kv_blocks,
            "block_size": stats.block_size, "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1), "steps": steps,
            "preemptions": stats.num_preemptions, "peak_running": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=64 << 20)
    parser.add_argument("--kv", nargs="+", default=["bf16", "int8"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--shortest", type=int, default=100)
    parser.add_argument("--longest", type=int, default=400)
    parser.add_argument("--output-tokens", type=int, default=512, help="the longest a request may run")
    parser.add_argument("--early-stop", type=float, help="requests end after output_tokens * u^2, u in [F, 1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--label", default="", help="e.g. 'quiet' when nothing else runs")
    parser.add_argument("--json")
    args = parser.parse_args()
    prompts = workload(args.requests, args.shortest, args.longest, args.seed)
    stops = draw_stops(len(prompts), args.output_tokens, args.early_stop, args.seed)
    result = {"host": host_info(), "label": args.label, "argv": sys.argv[1:], "load_before": os.getloadavg(),
              "runs": [], "ratios": {}}
    for round_index in range(args.rounds):
        for kv in args.kv:
            order = list(RULES) if round_index % 2 == 0 else list(RULES)[::-1]
            for rule in order:
                row = {"round": round_index, "read_gbs_before": round(read_gbs(), 1),
                       **run(rule, kv, args.kv_cache_memory, prompts, stops)}
                row["replayed_preemptions"] = replayed_preemptions(
                    rule, row["blocks"], row["block_size"], row["max_num_batched_tokens"], prompts,
                    args.output_tokens, stops)
                print(json.dumps(row), flush=True)
                result["runs"].append(row)
    for kv in {row["kv_cache_dtype"] for row in result["runs"]}:
        pairs = [[r for r in result["runs"] if r["kv_cache_dtype"] == kv and r["round"] == i] for i in
                 range(args.rounds)]
        ratios = [next(r for r in p if r["rule"] == "engine")["tokens_per_s"] /
                  next(r for r in p if r["rule"] == "whole_prompt")["tokens_per_s"] for p in pairs]
        result["ratios"][kv] = {"engine_vs_whole_prompt": [round(x, 3) for x in ratios],
                                "median": round(statistics.median(ratios), 3)}
    result["load_after"] = os.getloadavg()
    print(json.dumps({"ratios": result["ratios"], "load_before": result["load_before"],
                      "load_after": result["load_after"]}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
