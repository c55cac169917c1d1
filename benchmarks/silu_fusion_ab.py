"""SiLU-and-mul on the bf16 prefill path, interleaved A/B in one process, in the process's CPU time (comparable on a
host shared with other work; one thread): never in CI.

    OMP_NUM_THREADS=1 python benchmarks/silu_fusion_ab.py --baseline-lib OLD.so --conditions noisy

- `kernel`: the default model's gate/up (3072 x 576) at several row counts: the AMX GEMM then the separate
  SiLU-and-mul pass, against the GEMM with the pass fused into its epilogue (`dense_gemm(..., silu_and_mul=True)`).
- `pass`: the separate pass alone over a 2,016-row [gate | up] in this build against `--baseline-lib` (another
  build of the native library, e.g. the cached .so of the checkout before).
- `step`: a 2,016-token prefill step (9 prompts of 220-227 tokens) of the engine, fused against separate.
Prints one JSON object (medians; every repeat listed).
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
from hf_folder import hf_folder  # noqa: E402
from pagedserve_runner import make_engine, run_engine  # noqa: E402
from systems import WARMUP  # noqa: E402
from workload import WorkloadConfig, build_workload  # noqa: E402

from pagedserve.kernels.cpu.build import library_tier  # noqa: E402
from pagedserve.kernels.cpu.layer_ops import NativeLayerOps, silu_and_mul  # noqa: E402
from pagedserve.kernels.cpu.native import load_library  # noqa: E402
from pagedserve.quant.dense_layout import group_rows_in_place  # noqa: E402
from pagedserve.quant.dense_native import dense_gemm, dense_native_linear, gemm_isa  # noqa: E402


def _interleaved(variants: dict, calls: int, repeats: int) -> dict:
    times: dict[str, list[float]] = {k: [] for k in variants}
    for f in variants.values():
        f()
    for _ in range(repeats):
        for name, f in variants.items():
            t0 = time.process_time()
            for _ in range(calls):
                f()
            times[name].append(round((time.process_time() - t0) / calls * 1e3, 3))
    return {"median_ms": {k: statistics.median(v) for k, v in times.items()}, "runs_ms": times}


def kernel_ab(repeats: int) -> dict:
    w = (torch.randn(3072, 576, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16()
    group_rows_in_place(w)
    lin = dense_native_linear(w, None)
    out = {}
    for rows in (64, 512, 2016):
        x = torch.randn(rows, 576).bfloat16()
        out[rows] = _interleaved({"gemm_then_pass": lambda: silu_and_mul(dense_gemm(lin, x)),
                                  "fused": lambda: dense_gemm(lin, x, silu_and_mul=True)},
                                 max(3, 20000 // rows), repeats)
    return out


def pass_ab(baseline: str, repeats: int) -> dict:
    old = ctypes.CDLL(baseline)
    old.pagedserve_silu_and_mul.argtypes = load_library().pagedserve_silu_and_mul.argtypes
    gate_up = (torch.randn(2016, 3072) * 2).bfloat16()
    return _interleaved({"this_build": lambda: silu_and_mul(gate_up), "baseline": lambda: silu_and_mul(gate_up, lib=old)},
                        10, repeats)


def step_ab(model: str, repeats: int) -> dict:
    engine = make_engine(model, "bfloat16", 1, enable_prefix_caching=False)
    run_engine(engine, build_workload(WARMUP))
    prompts = build_workload(WorkloadConfig(num_requests=9, prompt_len_min=220, prompt_len_max=227,
                                            output_len_min=1, output_len_max=1))

    def step(fused: bool):
        NativeLayerOps.gemm_fuses_silu = fused  # this process only
        run_engine(engine, prompts)

    try:
        return _interleaved({"separate": lambda: step(False), "fused": lambda: step(True)}, 1, repeats)
    finally:
        NativeLayerOps.gemm_fuses_silu = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-lib", default=None, help="another build's native .so for the `pass` A/B")
    p.add_argument("--model", default=None, help="default: the embedded default model as an HF folder")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--conditions", default="unstated", help="e.g. quiet, or noisy (other work on the cores)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if gemm_isa() != "amx":
        raise SystemExit(f"the fused epilogue runs on AMX tiles only; this host's GEMM path is {gemm_isa()!r}")
    result = {"benchmark": "silu_fusion_ab", "cpu": cpu_model(), "isa_tier": library_tier(load_library()),
              "gemm_isa": gemm_isa(), "threads": 1, "clock": "process CPU time", "conditions": args.conditions,
              "kernel": kernel_ab(args.repeats)}
    if args.baseline_lib:
        result["pass"] = pass_ab(args.baseline_lib, args.repeats)
    result["step"] = step_ab(str(hf_folder(args.model)), args.repeats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
