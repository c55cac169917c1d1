"""Which device kernels a graphed decode step runs, and for how long, for decode_bench.py.

The H200 run of 2026-11-30 found a graphed batch-1 step of a 1B-shaped Llama bound by device time (1.69 ms, of
which ~0.6 ms is reading weights): many small kernels a layer. `kernel_run` records a few decode steps under
torch.profiler (CUPTI sees the kernels a CUDA graph replays) and returns, per kernel name, the launches and device
microseconds per step, with the totals: the kernels' summed time against the step's device time is what the gaps
between launches cost. Without CUDA (--dry-run) it records the CPU ops instead: the same fields, meaningless
numbers.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from step_split import queue_decodes

TOP = 25  # kernels printed and kept, by device time


def _rows(events, cuda: bool, steps: int) -> list[dict]:
    rows = []
    for event in events:
        if cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        micros = event.self_device_time_total if cuda else event.self_cpu_time_total
        rows.append({"kernel": event.key[:120], "launches_per_step": round(event.count / steps, 2),
                     "us_per_step": round(micros / steps, 2)})
    return sorted(rows, key=lambda r: r["us_per_step"], reverse=True)


def kernel_run(engine, prompts: list[list[int]], steps: int, tag: str, label: str) -> dict:
    """`steps` decode steps under the profiler: kernels per step, their summed device time, the top TOP."""
    cuda = engine.runner.device.type == "cuda"
    queue_decodes(engine, prompts, steps, tag)
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    done = 0
    with profile(activities=activities) as prof:
        while engine.has_unfinished_requests() and done < steps:
            engine.step()
            done += 1
        if cuda:
            torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    rows = _rows(prof.key_averages(), cuda, max(done, 1))
    out = {"steps": done, "recorded": "cuda kernels" if cuda else "cpu ops (no CUDA)",
           "launches_per_step": round(sum(r["launches_per_step"] for r in rows), 1),
           "kernel_us_per_step": round(sum(r["us_per_step"] for r in rows), 1), "top": rows[:TOP]}
    print(f"kernels ({label}, {done} decode steps): {out['launches_per_step']} launches and "
          f"{out['kernel_us_per_step']} us of kernels a step", flush=True)
    for row in rows[:TOP]:
        print(f"{row['launches_per_step']:8} {row['us_per_step']:9.2f}  {row['kernel']}", flush=True)
    return out
