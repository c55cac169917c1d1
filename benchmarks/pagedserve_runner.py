"""Drives the workload through pagedserve's LLMEngine in this process (add_request / step)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from metrics import RequestTiming
from workload import Workload


@dataclass(frozen=True, slots=True)
class EngineRun:
    timings: list[RequestTiming]
    peak_kv_blocks: int
    extra: dict


def make_engine(model_dir: str | None, dtype: str, threads: int, **overrides):
    """threads 0: the engine's own choice (its CPU budget, with the thread governor on a spinning pool)."""
    from pagedserve.engine import EngineConfig, LLMEngine
    from pagedserve.engine.host.tuning import tune_host

    config = EngineConfig(model=model_dir, dtype=dtype, num_threads=threads or None, **overrides)
    return LLMEngine(config, governor=tune_host(config))  # the host tuned as `pagedserve serve` tunes it


def run_engine(engine, workload: Workload) -> EngineRun:
    """Requests are added when their arrival time has passed; between arrivals with
    nothing to run the loop sleeps instead of spinning."""
    from pagedserve.engine import SamplingParams

    reqs = list(workload.requests)
    times: dict[str, list[float]] = {r.request_id: [] for r in reqs}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    peak_blocks, steps, step_s = 0, 0, 0.0
    start_stats = engine.stats()
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(reqs) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while nxt < len(reqs) and t0 + reqs[nxt].arrival_s <= now:
            r = reqs[nxt]
            params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
            engine.add_request(r.request_id, list(r.prompt_token_ids), params, arrival_time=t0 + r.arrival_s)
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, t0 + reqs[nxt].arrival_s - time.perf_counter()))
            continue
        outputs = engine.step()
        done = time.perf_counter()
        steps, step_s = steps + 1, step_s + (done - now)
        for out in outputs:
            new = out.outputs[0].new_token_ids
            times[out.request_id].extend([done] * len(new))
            tokens[out.request_id].extend(new)
        stats = engine.stats()
        peak_blocks = max(peak_blocks, stats.num_active_kv_blocks)
    end_stats = engine.stats()
    timings = [RequestTiming(r.request_id, t0 + r.arrival_s, tuple(times[r.request_id]),
                             tuple(tokens[r.request_id])) for r in reqs]
    extra = {"steps": steps, "mean_step_ms": 1e3 * step_s / max(steps, 1),
             "preemptions": end_stats.num_preemptions - start_stats.num_preemptions,
             "prefix_cache_hits": end_stats.prefix_cache_hits - start_stats.prefix_cache_hits,
             "num_kv_blocks": end_stats.num_kv_blocks}
    return EngineRun(timings, peak_blocks, extra)
