"""Decode step time with the native small-batch step against the per-op torch path, per batch size (never in CI).

    python benchmarks/native_step_crossover.py                          # bf16, batches 1-32, default model
    python benchmarks/native_step_crossover.py --dtype float32 --batches 1 2 4 8

Two engines on the same model (native step on for every batch size, and off) decode `--tokens` greedy tokens for
each batch of 64-token prompts, interleaved, `--repeats` times; each entry is the median decode step (ms) of a
run, and `torch_over_native` the ratio of the best runs. Where it drops below 1 is the crossover that
`EngineConfig.native_step_max_batch` should sit under on that machine. Prints one JSON object.

The torch engine builds no native step by default (`--torch-limit 0`), and then holds dense fp32 weights as oneDNN's
packed copies; a serving engine builds one, whose kernels make every weight plain, and its torch path multiplies
those. `--torch-limit 1` measures that path (batches of 2 and more; batch 1 is then native in both engines).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def step_ms(engine, batch: int, tokens: int, tag: str) -> float:
    from pagedserve.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", list(range(1000 + i, 1064 + i)), params)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[:-1] or times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16, 32])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-limit", type=int, default=0, choices=[0, 1],
                        help="the torch engine's native_step_max_batch (1: weights held as a serving engine holds them)")
    args = parser.parse_args()
    from pagedserve.engine import EngineConfig, LLMEngine

    engines = {name: LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                            native_step_max_batch=limit, enable_prefix_caching=False))
               for name, limit in (("native", max(args.batches)), ("torch", args.torch_limit))}
    load_start = os.getloadavg()[0]
    rows = {}
    for batch in args.batches:
        runs: dict[str, list[float]] = {name: [] for name in engines}
        for rep in range(args.repeats):
            for name, engine in (engines.items() if rep % 2 == 0 else reversed(engines.items())):
                runs[name].append(round(step_ms(engine, batch, args.tokens, f"{batch}-{rep}"), 2))
        rows[str(batch)] = {**{f"{k}_ms": v for k, v in runs.items()},
                            "torch_over_native": round(min(runs["torch"]) / min(runs["native"]), 3)}
    print(json.dumps({"cpu": cpu_model(), "dtype": args.dtype, "threads": args.threads, "torch_limit": args.torch_limit,
                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                      "load_avg_1m": [load_start, os.getloadavg()[0]],
                      "batches": rows}, indent=2))


if __name__ == "__main__":
    main()
