"""One dtype of the comparison: every selected system (in-process workers and servers alike) is started
together and warmed up, then the repeats rotate over all of them (so load drift on a shared machine spreads
over every system), then the Poisson runs, then, with --contention, the repeats again beside a busy core.
Every driver started here is closed in a `finally`, also on SIGTERM (compare.py turns it into SystemExit).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from contention import busy_core
from metrics import RunResult, median_result, summarize
from workload import Workload, with_poisson_arrivals

import drivers

NO_ARRIVALS = ("hf_static",)  # one padded batch has no notion of arrivals
# Every system of a dtype is resident at once; below this much free memory, starting one more would
# swap or get killed mid-run, which is worse than a clear error naming the systems to drop.
MIN_FREE_GIB = 3.0


@dataclass(frozen=True, slots=True)
class PhasePlan:
    repeats: int
    poisson_load: float  # per-system Poisson runs at this fraction of each system's own saturation rate; 0: off
    common_rate: float | None = None  # one rate for every system; None: poisson_load x the slowest system's; 0: off
    contention: bool = False

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.poisson_load < 0 or (self.common_rate is not None and self.common_rate < 0):
            raise ValueError("poisson_load and common_rate must be >= 0")


@dataclass
class PhaseResults:
    runs: dict[str, list[RunResult]]
    timings: dict[str, list]
    poisson: dict[str, dict]
    poisson_common: dict
    contended: dict[str, list[RunResult]]


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, file=sys.stderr, flush=True)


def saturation_rate(median: dict, num_requests: int) -> float:
    """All-at-once requests/s a system sustained: the rate its Poisson runs are scaled from."""
    return num_requests / median["duration_s"]


def choose_common_rate(medians: dict[str, dict], num_requests: int, load: float,
                       explicit: float | None) -> float | None:
    """The one Poisson rate every system of a dtype gets: `explicit` if given (0 disables), else `load` times
    the slowest system's saturation rate, so every system can keep up and the rows are one workload."""
    if explicit is not None:
        return explicit if explicit > 0 else None
    rates = [saturation_rate(m, num_requests) for n, m in medians.items() if n not in NO_ARRIVALS]
    if load <= 0 or not rates:
        return None
    return load * min(rates)


def rotation(names: list[str], rep: int) -> list[str]:
    k = rep % len(names)
    return names[k:] + names[:k]


def check_token_counts(name: str, timings: list, workload: Workload) -> None:
    """Every system must generate exactly the workload's tokens (ignore_eos): a server that truncates (llama-server's
    fixed slot context answers HTTP 200 with fewer tokens) would otherwise be scored on less work."""
    expected = sum(r.max_tokens for r in workload.requests)
    got = sum(t.num_output_tokens for t in timings)
    if len(timings) != len(workload.requests) or got != expected:
        raise SystemExit(f"{name}: {len(timings)} requests / {got} output tokens, the workload has "
                         f"{len(workload.requests)} / {expected}; its results would not be comparable")


def run_one(driver, name: str, dtype: str, workload: Workload) -> tuple[RunResult, list]:
    timings, peak, extra = driver.run(workload)
    check_token_counts(name, timings, workload)
    return summarize(name, dtype, timings, workload.num_prompt_tokens, peak, extra), timings


def run_repeats(live: dict, workload: Workload, repeats: int, dtype: str, tag: str = "") -> tuple[dict, dict]:
    runs: dict[str, list[RunResult]] = {n: [] for n in live}
    timings: dict[str, list] = {}
    for rep in range(repeats):
        for name in rotation(list(live), rep):
            res, timings[name] = run_one(live[name], name, dtype, workload)
            runs[name].append(res)
            log(f"[{dtype}]{tag} rep {rep + 1} {name}: {res.output_tok_s:.1f} out tok/s, "
                f"TTFT p50 {res.ttft_p50_s:.2f} s, ITL p50 {res.itl_p50_ms:.0f} ms")
    return runs, timings


def run_poisson(live: dict, workload: Workload, rates: dict[str, float], dtype: str, load: float | None) -> dict:
    out = {}
    for name, rate in rates.items():
        res, _ = run_one(live[name], name, dtype, with_poisson_arrivals(workload, rate))
        out[name] = {**res.to_dict(), "rate_req_s": rate, "load": load}
        log(f"[{dtype}] poisson {rate:.2f} req/s {name}: {res.output_tok_s:.1f} out tok/s, "
            f"TTFT p50 {res.ttft_p50_s:.2f} s")
    return out


def _poisson_runs(live: dict, workload: Workload, runs: dict, plan: PhasePlan, dtype: str) -> tuple[dict, dict]:
    medians = {n: median_result(rs) for n, rs in runs.items()}
    n = len(workload.requests)
    own = {name: plan.poisson_load * saturation_rate(m, n) for name, m in medians.items()
           if name not in NO_ARRIVALS} if plan.poisson_load > 0 else {}
    poisson = run_poisson(live, workload, own, dtype, plan.poisson_load)
    rate = choose_common_rate(medians, n, plan.poisson_load, plan.common_rate)
    if rate is None:
        return poisson, {}
    rule = "given" if plan.common_rate else f"{plan.poisson_load:.0%} of the slowest system's saturation rate"
    common = run_poisson(live, workload, {m: rate for m in medians if m not in NO_ARRIVALS}, dtype, None)
    return poisson, {"rate_req_s": rate, "rule": rule, "results": common}


def mem_available_gib() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def start_all(names: list[str], spec: drivers.DriverSpec, live: dict) -> None:
    """Fills `live` as systems come up, so the caller's `finally` also stops a partial start."""
    for name in names:
        free = mem_available_gib()
        if free < MIN_FREE_GIB:
            raise SystemExit(f"only {free:.1f} GiB free with {', '.join(live)} running: cannot also start {name}; "
                             f"pass fewer --systems")
        log(f"[{spec.dtype}] starting {name} ({free:.1f} GiB free)")
        live[name] = drivers.start(name, spec)


def run_systems(names: list[str], spec: drivers.DriverSpec, workload: Workload, plan: PhasePlan) -> PhaseResults:
    live: dict[str, drivers.Driver] = {}
    try:
        start_all(names, spec, live)
        runs, timings = run_repeats(live, workload, plan.repeats, spec.dtype)
        poisson, common = _poisson_runs(live, workload, runs, plan, spec.dtype)
        contended = {}
        if plan.contention:
            with busy_core() as core:
                log(f"[{spec.dtype}] contention: one busy process pinned to core {core}")
                contended, _ = run_repeats(live, workload, plan.repeats, spec.dtype, " contended")
        return PhaseResults(runs, timings, poisson, common, contended)
    finally:
        for driver in live.values():
            driver.close()
