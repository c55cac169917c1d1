"""What the KV cache dtype buys on long prompts: one fixed KV budget, a workload of 2-8k-token prompts all submitted
at once, and per cache dtype (same run, same prompts): tokens/s, time to first token, preemptions, the peak number of
sequences running, and the blocks the budget gave. A 16-bit cache that holds one or two such prompts queues the rest
(or preempts when decodes outgrow it); an 8-bit cache holds about twice as many.

Where the 16-bit cache is memory-bound (the case the 8-bit caches are for): every request (prompt + output) fits
the 16-bit budget but fewer than two of the longest do, and output is at least 1/3 of the prompt tokens (decode then
takes >= 90% of the 16-bit run's time at ~0.5 ms per prompt token and ~15 ms per output token at 4k on 2 cores;
docs/kv-cache-formats.md, "The long-context benefit", derives the rule). The result records, per dtype, how many of
the longest requests its budget holds, and the output share.
`--rounds N` runs the dtypes N times interleaved (A B C A B C ...) and reports each dtype's median; `--alternate`
reverses every other round (A B C C B A ...). Every run is also compared with the first dtype's rate interpolated in
time between its nearest runs on either side (`vs_first_bracketed`): a VM whose rate drifts steadily by tens of
percent over minutes (seen on the SPR guest) moves every other figure here, not that one. Before every run (and
after the last) the read bandwidth of a 1 GiB buffer is recorded (`read_gbs_before`, `read_gbs_after`), so that a
slow stretch of the VM shows in the raw file beside the runs it slowed.

    python benchmarks/kv_long_context.py --kv-cache-memory 256MiB --json long.json   # bf16 vs int8 vs fp8
    python benchmarks/kv_long_context.py --kv-cache-memory 128MiB --requests 4 --shortest 2048 --longest 4096 \
        --output-tokens 1024 --rounds 3 --json long.json                              # 16-bit memory-bound
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
from fp8_kv_accuracy import host_info  # noqa: E402
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedserve.service.cli import parse_bytes  # noqa: E402
from read_bandwidth import read_bandwidth  # noqa: E402


def read_gbs() -> float:
    """GB/s that torch's threads read from a 1 GiB buffer, best of 3 (half a second): a probe of the host's rate
    at that moment, not a peak."""
    return read_bandwidth(1.0, 3) / 1e9


def workload(requests: int, shortest: int, longest: int, seed: int) -> list[list[int]]:
    """Prompt lengths spread evenly over [shortest, longest], shuffled; token ids from the ordinary vocabulary."""
    rng = random.Random(seed)
    lengths = [shortest + (longest - shortest) * i // max(requests - 1, 1) for i in range(requests)]
    rng.shuffle(lengths)
    return [[rng.randrange(200, 20000) for _ in range(n)] for n in lengths]


def run(kv: str, memory: int, prompts: list[list[int]], output_tokens: int, max_num_seqs: int,
        block_size: int = 16) -> dict:
    engine = LLMEngine(EngineConfig(kv_cache_dtype=kv, kv_cache_memory=memory, max_num_seqs=max_num_seqs,
                                    block_size=block_size))
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for n, prompt in enumerate(prompts):
        engine.add_request(f"r{n}", prompt, params)
    first_token: dict[str, float] = {}
    peak = steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first_token:
                first_token[out.request_id] = time.perf_counter() - t0
        steps += 1
        peak = max(peak, engine.stats().num_running)
    seconds = time.perf_counter() - t0
    stats = engine.stats()
    ttft = sorted(first_token.values())
    prompt_tokens = sum(len(p) for p in prompts)
    return {"kv_cache_dtype": stats.kv_cache_dtype, "kv_cache_memory": memory, "blocks": stats.num_kv_blocks,
            "tokens_in_budget": stats.num_kv_blocks * stats.block_size, "requests": len(prompts),
            "prompt_tokens": prompt_tokens, "output_tokens": len(prompts) * output_tokens, "seconds": seconds,
            "steps": steps, "peak_running": peak, "preemptions": stats.num_preemptions,
            "total_tokens_per_s": (prompt_tokens + len(prompts) * output_tokens) / seconds,
            "output_tokens_per_s": len(prompts) * output_tokens / seconds,
            "ttft_mean_s": statistics.fmean(ttft), "ttft_median_s": statistics.median(ttft), "ttft_max_s": ttft[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=256 << 20)
    parser.add_argument("--kv", nargs="+", default=["bf16", "int8", "fp8"])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--shortest", type=int, default=2048)
    parser.add_argument("--longest", type=int, default=8000)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the engine's default: 16)")
    parser.add_argument("--rounds", type=int, default=1, help="dtypes interleaved round by round; medians reported")
    parser.add_argument("--alternate", action="store_true",
                        help="every other round runs the dtypes in reverse order (A B C, C B A, ...): each later "
                             "dtype then has a first-dtype run on both sides, and the bracketed ratios use both")
    parser.add_argument("--label", default="", help="e.g. 'noisy' when other jobs share the machine")
    parser.add_argument("--json")
    args = parser.parse_args()
    prompts = workload(args.requests, args.shortest, args.longest, args.seed)
    runs: dict[str, list[dict]] = {kv: [] for kv in args.kv}
    sequence: list[tuple[str, dict, float]] = []  # every run in the order it ran, with its midpoint in time
    for r in range(args.rounds):
        for kv in (args.kv[::-1] if args.alternate and r % 2 else args.kv):
            probe = read_gbs()
            start = time.monotonic()
            runs[kv].append(run(kv, args.kv_cache_memory, prompts, args.output_tokens, args.max_num_seqs,
                                args.block_size))
            runs[kv][-1]["read_gbs_before"] = probe
            sequence.append((kv, runs[kv][-1], (start + time.monotonic()) / 2))
            print(json.dumps({"round": r, **runs[kv][-1]}), flush=True)
    rows = [median_row(runs[kv], max(len(p) for p in prompts) + args.output_tokens) for kv in args.kv]
    base = rows[0]["total_tokens_per_s"]
    first = runs[args.kv[0]]
    for kv, row in zip(args.kv, rows):
        row["tokens_per_s_vs_first"] = row["total_tokens_per_s"] / base
        # Each round against the first dtype's run of the same round: the VM's rate drifts by tens of percent over
        # minutes, which a ratio of medians taken from different rounds carries and these do not.
        row["vs_first_per_round"] = [r["total_tokens_per_s"] / f["total_tokens_per_s"] for r, f in zip(runs[kv], first)]
        row["vs_first_median_of_rounds"] = statistics.median(row["vs_first_per_round"])
        row["vs_first_bracketed"] = bracketed_ratios(sequence, kv, args.kv[0])
        if row["vs_first_bracketed"]:
            row["vs_first_median_bracketed"] = statistics.median(row["vs_first_bracketed"])
        print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
    result = {**host_info(), "label": args.label, "args": vars(args), "rows": rows,
              "read_gbs_after": read_gbs()}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def bracketed_ratios(sequence: list[tuple[str, dict, float]], kv: str, first: str) -> list[float]:
    """Each run of `kv` against the `first` dtype's rate at the same moment, interpolated in time between the
    nearest `first` runs before and after it (the one side only at an end): a rate that drifts steadily over
    minutes cancels out, which a same-round ratio keeps part of."""
    ratios = []
    for i, (name, row, t) in enumerate(sequence):
        if name != kv or kv == first:
            continue
        before = next(((r, u) for n, r, u in reversed(sequence[:i]) if n == first), None)
        after = next(((r, u) for n, r, u in sequence[i + 1:] if n == first), None)
        if before and after:
            (rb, tb), (ra, ta) = before, after
            low, high = rb["total_tokens_per_s"], ra["total_tokens_per_s"]
            rate = low + (high - low) * (t - tb) / (ta - tb)
        else:
            rate = (before or after)[0]["total_tokens_per_s"]
        ratios.append(row["total_tokens_per_s"] / rate)
    return ratios


def median_row(runs: list[dict], longest_request: int) -> dict:
    """One dtype's rounds: the round of median total tokens/s, each round's figures kept; how many of the longest
    requests (prompt + output) the budget holds, and the output tokens' share of all tokens."""
    ordered = sorted(runs, key=lambda row: row["total_tokens_per_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["holds_longest_requests"] = row["tokens_in_budget"] // longest_request
    row["output_share"] = row["output_tokens"] / (row["output_tokens"] + row["prompt_tokens"])
    row["rounds"] = [{k: r[k] for k in ("total_tokens_per_s", "ttft_mean_s", "preemptions", "peak_running",
                                        "read_gbs_before")}
                     for r in runs]
    return row


if __name__ == "__main__":
    main()
