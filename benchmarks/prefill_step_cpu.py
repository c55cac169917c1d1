"""CPU seconds of one prefill step of the saturation workload's shape (9 prompts of 220-227 tokens, 2,016 tokens in
one step, one output token each) on the engine in-process: run in each checkout, one after another, to compare two
builds on a host shared with other work (the process's CPU time, not wall time). Never in CI.

    OMP_NUM_THREADS=1 python benchmarks/prefill_step_cpu.py --threads 1     # default model's HF folder, bf16
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
from pagedserve_runner import make_engine, run_engine  # noqa: E402
from systems import WARMUP  # noqa: E402
from workload import WorkloadConfig, build_workload  # noqa: E402

from pagedserve.kernels.cpu.build import library_tier  # noqa: E402
from pagedserve.kernels.cpu.native import load_library  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded default model as an HF folder")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    engine = make_engine(str(hf_folder(args.model)), args.dtype, args.threads, enable_prefix_caching=False)
    prompts = build_workload(WorkloadConfig(num_requests=9, prompt_len_min=220, prompt_len_max=227,
                                            output_len_min=1, output_len_max=1))
    run_engine(engine, build_workload(WARMUP))
    run_engine(engine, prompts)
    step_ms = []
    for _ in range(args.steps):
        t0 = time.process_time()
        run_engine(engine, prompts)
        step_ms.append(round((time.process_time() - t0) * 1e3, 1))
    print(json.dumps({"benchmark": "prefill_step_cpu", "cpu": cpu_model(), "isa_tier": library_tier(load_library()),
                      "dtype": args.dtype, "threads": args.threads, "step_ms": step_ms,
                      "median_ms": statistics.median(step_ms)}))


if __name__ == "__main__":
    main()
