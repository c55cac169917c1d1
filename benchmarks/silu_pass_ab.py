"""The native SiLU-and-mul pass (kernels/cpu/layer_ops.c) of this build against another build's, in bf16 on the
default model's width (1536), interleaved, in the process's CPU time (comparable on a host shared with other work):
never in CI. Also checks that both builds give the same bits for every bf16 gate.

    OMP_NUM_THREADS=1 python benchmarks/silu_pass_ab.py --baseline-lib OLD.so --conditions noisy
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402

from pagedserve.kernels.cpu.build import library_tier  # noqa: E402
from pagedserve.kernels.cpu.layer_ops import silu_and_mul  # noqa: E402
from pagedserve.kernels.cpu.native import load_library  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-lib", required=True, help="another build's native .so (e.g. the checkout before's)")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 512, 2016])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--conditions", default="unstated", help="e.g. quiet, or noisy (other work on the cores)")
    args = p.parse_args()
    torch.set_num_threads(1)
    this, old = load_library(), ctypes.CDLL(args.baseline_lib)
    old.pagedserve_silu_and_mul.argtypes = this.pagedserve_silu_and_mul.argtypes
    gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(64, 1024)
    every = torch.cat([gates, torch.randn(64, 1024).bfloat16()], dim=1).contiguous()
    same = torch.equal(silu_and_mul(every).view(torch.int16), silu_and_mul(every, lib=old).view(torch.int16))
    ms: dict[int, dict] = {}
    for rows in args.rows:
        gate_up = (torch.randn(rows, 2 * 1536) * 2).bfloat16()
        builds = {"this_build": this, "baseline": old}
        runs: dict[str, list[float]] = {k: [] for k in builds}
        calls = max(3, 20000 // rows)
        for _ in range(args.repeats):
            for name, lib in builds.items():
                t0 = time.process_time()
                for _ in range(calls):
                    silu_and_mul(gate_up, lib=lib)
                runs[name].append(round((time.process_time() - t0) / calls * 1e3, 4))
        ms[rows] = {"median_ms": {k: statistics.median(v) for k, v in runs.items()}, "runs_ms": runs}
    print(json.dumps({"benchmark": "silu_pass_ab", "cpu": cpu_model(), "isa_tier": library_tier(this), "threads": 1,
                      "clock": "process CPU time", "conditions": args.conditions, "width": 1536,
                      "same_bits_every_bf16_gate": same, "rows": ms}, indent=1))


if __name__ == "__main__":
    main()
