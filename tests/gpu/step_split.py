"""Where a decode step's wall time goes, for decode_bench.py: the device's share and the host's, per step.

At batch 1 a Llama-3.2-1B-shaped fp16 model's captured forward reads 2.5 GB of weights (~0.6 ms on an H200), yet a
graphed decode step took 2.2 ms, which leaves ~1.5 ms for the host or for a slower graph. `split_run` times a short
decode run with CUDA events around the step's two big pieces of device work, the graph's replay and the LM head
(outside the graph), read after the run, so no step waits for them; the engine's phases (schedule, execute, update)
get host wall clocks. host_ms_per_step is the step's wall time less that device time: the time the device idles
while the host schedules, prepares, samples and updates (host work enqueued while the graph runs overlaps it and is
not counted; the sampler's few small kernels count as host). Without CUDA (--dry-run) the device time is the
runner's forward on the host clock, the same fields. `profile_run` prints a cProfile of another short run (top
functions by own and by cumulative time) and returns its top own-time functions per step.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from contextlib import contextmanager
from pathlib import Path

import torch

PROFILE_TOP = 20  # functions printed per ordering
JSON_TOP = 8  # of them, the ones the JSON keeps


class Clock:
    """Intervals summed per key: CUDA events on the device (elapsed only read at the end), else perf_counter."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}
        self.host: dict[str, float] = {}

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, key: str, start) -> None:
        if self.cuda:
            self.events.setdefault(key, []).append((start, self.mark()))
        else:
            self.host[key] = self.host.get(key, 0.0) + time.perf_counter() - start

    def totals_ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {key: sum(a.elapsed_time(b) for a, b in pairs) for key, pairs in self.events.items()}
        return {key: seconds * 1e3 for key, seconds in self.host.items()}


def _timed(clock: Clock, key: str, fn):
    def wrapper(*args, **kwargs):
        start = clock.mark()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.add(key, start)
    return wrapper


class _TimedGraph:
    """A captured graph whose replays are timed (DecodeGraphs.run calls only replay())."""

    def __init__(self, graph, clock: Clock):
        self.graph, self.clock = graph, clock

    def replay(self) -> None:
        start = self.clock.mark()
        self.graph.replay()
        self.clock.add("graph", start)


@contextmanager
def _hooks(engine, device_clock: Clock, host_clock: Clock):
    """Instance attributes over the engine's methods for the run (the class's are untouched), removed after it."""
    runner, scheduler = engine.runner, engine.scheduler
    patched = [(scheduler, "schedule"), (runner, "execute"), (scheduler, "update")]
    for owner, name in patched:
        setattr(owner, name, _timed(host_clock, name, getattr(owner, name)))
    graphs = runner.cuda_graphs
    saved_graphs = None if graphs is None else dict(graphs.graphs)
    if device_clock.cuda:
        if graphs is not None:
            graphs.graphs.update({size: _TimedGraph(g, device_clock) for size, g in saved_graphs.items()})
        runner.model.compute_logits = _timed(device_clock, "lm_head", runner.model.compute_logits)
        patched.append((runner.model, "compute_logits"))
    else:  # the host computes: the whole forward (native step or torch, LM head included) is the "device" time
        runner.forward = _timed(device_clock, "forward", runner.forward)
        patched.append((runner, "forward"))
    try:
        yield
    finally:
        for owner, name in patched:
            delattr(owner, name)
        if saved_graphs is not None:
            graphs.graphs.clear()
            graphs.graphs.update(saved_graphs)


def queue_decodes(engine, prompts: list[list[int]], steps: int, tag: str) -> None:
    """Queues `prompts` for steps + 1 tokens each and runs their prefill step (the caller times the rest)."""
    from pagedserve.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    engine.step()


def split_run(engine, prompts: list[list[int]], steps: int, tag: str) -> dict:
    """Per decode step: wall, device (graph replay + LM head) and host (the rest) milliseconds, and the phases'."""
    cuda = engine.runner.device.type == "cuda"
    device_clock, host_clock = Clock(cuda), Clock(False)
    queue_decodes(engine, prompts, steps, tag)
    done = 0
    with _hooks(engine, device_clock, host_clock):
        start = time.perf_counter()
        while engine.has_unfinished_requests() and done < steps:
            engine.step()
            done += 1
        wall_ms = (time.perf_counter() - start) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    device, phases = device_clock.totals_ms(), host_clock.totals_ms()
    per = max(done, 1)
    device_ms = sum(device.values())
    out = {"steps": done, "step_ms": round(wall_ms / per, 3), "device_ms_per_step": round(device_ms / per, 3),
           "host_ms_per_step": round((wall_ms - device_ms) / per, 3),
           "device_timing": "cuda events: graph replay + LM head" if cuda else "host clock: runner.forward"}
    out.update({f"{key}_ms_per_step": round(ms / per, 3) for key, ms in sorted(device.items())})
    out.update({f"{key}_wall_ms_per_step": round(ms / per, 3) for key, ms in sorted(phases.items())})
    return out


def profile_run(engine, prompts: list[list[int]], steps: int, tag: str, label: str) -> list[dict]:
    """cProfile of `steps` decode steps, printed (top PROFILE_TOP by tottime, then by cumtime); returns the
    top JSON_TOP by own time, in milliseconds per step."""
    queue_decodes(engine, prompts, steps, tag)
    profiler = cProfile.Profile()
    done = 0
    profiler.enable()
    while engine.has_unfinished_requests() and done < steps:
        engine.step()
        done += 1
    profiler.disable()
    while engine.has_unfinished_requests():
        engine.step()
    per = max(done, 1)
    rows = [{"function": f"{Path(func[0]).name}:{func[1]}({func[2]})", "calls_per_step": round(calls / per, 1),
             "tottime_ms_per_step": round(tottime * 1e3 / per, 3), "cumtime_ms_per_step": round(cum * 1e3 / per, 3)}
            for func, (_, calls, tottime, cum, _) in pstats.Stats(profiler).stats.items()]
    for order in ("tottime", "cumtime"):
        print(f"host profile ({label}, {done} decode steps, top {PROFILE_TOP} by {order}; ms per step):", flush=True)
        print(f"{'calls':>7} {'tottime':>8} {'cumtime':>8}  function")
        for row in sorted(rows, key=lambda r: r[f"{order}_ms_per_step"], reverse=True)[:PROFILE_TOP]:
            print(f"{row['calls_per_step']:7} {row['tottime_ms_per_step']:8.3f} {row['cumtime_ms_per_step']:8.3f}  "
                  f"{row['function']}", flush=True)
    return sorted(rows, key=lambda r: r["tottime_ms_per_step"], reverse=True)[:JSON_TOP]
