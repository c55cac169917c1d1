"""Where one batch-1 decode step goes on the default model (never in CI).

    python benchmarks/decode_step_profile.py                       # bf16, 1 stream, 128 decode steps
    python benchmarks/decode_step_profile.py --streams 4 --no-native-step

One request per stream (a 64-token prompt, greedy, EOS ignored) is prefilled, then `--steps` decode steps run
under the torch profiler. Every operator's self time is put into one bucket: matmuls (oneDNN/MKL, and the native
GEMVs), attention (the native decode kernel and KV write), elementwise (RMSNorm, RoPE, SiLU, adds, casts, copies,
the embedding), the native small-batch step (one C call for the whole layer stack, when it runs) and the rest
of the step's wall time: Python, dispatch, scheduler, sampler, detokenizer. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_engine import label_native_calls  # noqa: E402

MATMUL = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm",
          "native::linear")
ATTENTION = ("native::decode_attention", "native::write_kv", "native::store_kv", "native::prefill_attention_native")
STEP = ("native::decode_step",)


def bucket(key: str) -> str:
    if key in MATMUL:
        return "matmul"
    if key in ATTENTION:
        return "attention"
    if key in STEP:
        return "native_step"
    if key.startswith(("aten::", "native::")):
        return "elementwise_and_copies"
    return "other_ops"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def phase_clock(engine) -> dict[str, float]:
    """Wraps the scheduler (schedule and update), the model runner's forward and its sampler of this engine instance;
    returns their running totals."""
    totals: dict[str, float] = defaultdict(float)
    owners = {"scheduler": engine.scheduler, "runner": engine.runner}
    for label, attr in (("scheduler", "schedule"), ("scheduler", "update"), ("runner", "forward")):
        inner = getattr(owners[label], attr)

        def timed(*a, _inner=inner, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                totals[_label] += time.perf_counter() - t0

        setattr(owners[label], attr, timed)
    sampler = engine.runner.sampler

    def sample(*a, **k):
        t0 = time.perf_counter()
        try:
            return sampler(*a, **k)
        finally:
            totals["sampler"] += time.perf_counter() - t0

    engine.runner.sampler = sample
    return totals


def label_native_step(engine) -> None:
    """The native step is one ctypes call the profiler cannot see into: label it (this engine only)."""
    from torch.profiler import record_function

    step = engine.runner.native_step
    if step is None:
        return
    inner = step.run

    def labelled(*a, **k):
        with record_function("native::decode_step"):
            return inner(*a, **k)

    step.run = labelled


def run(args: argparse.Namespace) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                          native_step_max_batch=0 if args.no_native_step else 8)
    engine = LLMEngine(config)
    label_native_calls()
    params = SamplingParams(temperature=0.0, max_tokens=2 * args.steps + args.warmup + 2, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"r{i}", list(range(1000 + i, 1064 + i)), params)
    for _ in range(args.warmup + 1):  # prefill, then warm-up decode steps
        engine.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    unprofiled = time.perf_counter() - t0
    label_native_step(engine)
    totals = phase_clock(engine)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    wall = time.perf_counter() - t0
    per_bucket: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        per_bucket[bucket(event.key)] += event.self_cpu_time_total / 1e6
    accounted = sum(v for k, v in per_bucket.items() if k != "other_ops")
    ms = lambda s: round(1e3 * s / args.steps, 3)  # noqa: E731
    return {
        "cpu": cpu_model(), "threads": torch.get_num_threads(), "dtype": args.dtype, "streams": args.streams,
        "native_step": not args.no_native_step, "steps": args.steps,
        "step_ms_unprofiled": ms(unprofiled), "tok_s_unprofiled": round(args.streams * args.steps / unprofiled, 1),
        "step_ms": ms(wall),
        "per_step_ms": {**{k: ms(v) for k, v in sorted(per_bucket.items()) if k != "other_ops"},
                        "python_dispatch_scheduler_sampler_detok": ms(wall - accounted)},
        "phases_ms": {k: ms(v) for k, v in totals.items()},
        "note": "profiler on: absolute times include its overhead; shares are what to read",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--no-native-step", action="store_true", help="the per-op torch path only")
    print(json.dumps(run(parser.parse_args()), indent=2))


if __name__ == "__main__":
    main()
