"""One dtype of the comparison: every selected system (in-process workers and servers alike) is started
together and warmed up, then the repeats rotate over all of them (so load drift on a shared machine spreads
over every system; each run starts once the cores are quiet, so none starts beside the previous one's spinning
threads), then the Poisson runs, then, with --contention, the repeats again beside a busy core.
When they do not all fit in memory they run in waves of systems that do (start_wave).
Every driver started here is closed in a `finally`, also on SIGTERM (compare.py turns it into SystemExit).
A system that fails to start or to run (a crash, a server error, truncated output) is closed and its rows end
there, with a note in `PhaseResults.failures`; the other systems go on.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from contention import busy_core, wait_for_quiet_cpus
from metrics import RunResult, median_result, summarize
from workload import Workload, with_poisson_arrivals

import drivers

NO_ARRIVALS = ("hf_static",)  # one padded batch has no notion of arrivals
# Resident size of one started system (GiB, measured on SmolLM2-135M fp32 at 2 GiB vLLM KV space: a vLLM
# instance is three processes plus its KV space). Systems of a dtype start together while they fit with
# MARGIN_GIB to spare; the rest run in a later wave, so a large --systems list never swaps or OOMs.
FOOTPRINT_GIB = {"vllm": 4.5, "pagedserve": 2.0, "hf": 2.0, "llama-server": 1.0}
MARGIN_GIB = 2.0
# Other processes' CPUs below which a run may start (contention.wait_for_quiet_cpus): an idle host reads ~0.01-0.05.
QUIET_CPUS = 0.15


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


class PeerFailure(RuntimeError):
    """One system's run cannot be scored (truncated output, a server error): that system stops, the run goes on."""


@dataclass
class PhaseResults:
    runs: dict[str, list[RunResult]]
    timings: dict[str, list]
    poisson: dict[str, dict]
    poisson_common: dict
    contended: dict[str, list[RunResult]]
    failures: dict[str, str] = field(default_factory=dict)  # system -> why its rows end where they do


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
    if not names:
        return []
    k = rep % len(names)
    return names[k:] + names[:k]


def check_token_counts(name: str, timings: list, workload: Workload) -> None:
    """Every system must generate exactly the workload's tokens (ignore_eos): a server that truncates (llama-server's
    fixed slot context answers HTTP 200 with fewer tokens) would otherwise be scored on less work."""
    expected = sum(r.max_tokens for r in workload.requests)
    got = sum(t.num_output_tokens for t in timings)
    if len(timings) != len(workload.requests) or got != expected:
        raise PeerFailure(f"{name}: {len(timings)} requests / {got} output tokens, the workload has "
                         f"{len(workload.requests)} / {expected}; its results would not be comparable")


def run_one(driver, name: str, dtype: str, workload: Workload, busy_by_design: float = 0.0) -> tuple[RunResult, list]:
    """One measured run, started once the cores are as quiet as the phase means them to be (`busy_by_design`: the
    CPUs a contention run's busy process takes)."""
    waited, busy = wait_for_quiet_cpus(busy_below=busy_by_design + QUIET_CPUS)
    if busy >= busy_by_design + QUIET_CPUS:
        log(f"{name}: the cores were not quiet after {waited:.0f} s (others busy {busy:.2f} CPUs); measuring anyway")
    timings, peak, extra = driver.run(workload)
    check_token_counts(name, timings, workload)
    return summarize(name, dtype, timings, workload.num_prompt_tokens, peak, extra), timings


def guarded(live: dict, failures: dict[str, str], name: str, action, *args):
    """action(*args), or None after closing `name`, dropping it from `live` and noting why (an Exception; ^C and
    SIGTERM's SystemExit still end the whole run)."""
    try:
        return action(*args)
    except Exception as exc:  # noqa: BLE001  (any failure of one peer is that peer's, not the run's)
        failures[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log(f"{name} failed, its remaining rows are skipped: {failures[name]}")
        driver = live.pop(name, None)
        if driver is not None:
            try:
                driver.close()
            except Exception:  # noqa: BLE001
                pass
        return None


def run_repeats(live: dict, workload: Workload, repeats: int, dtype: str, tag: str = "",
                failures: dict[str, str] | None = None, busy_by_design: float = 0.0) -> tuple[dict, dict]:
    failures = {} if failures is None else failures
    runs: dict[str, list[RunResult]] = {n: [] for n in live}
    timings: dict[str, list] = {}
    for rep in range(repeats):
        for name in rotation(list(live), rep):
            if name not in live:
                continue
            done = guarded(live, failures, name, run_one, live[name], name, dtype, workload, busy_by_design)
            if done is None:
                continue
            res, timings[name] = done
            runs[name].append(res)
            log(f"[{dtype}]{tag} rep {rep + 1} {name}: {res.output_tok_s:.1f} out tok/s, "
                f"TTFT p50 {res.ttft_p50_s:.2f} s, ITL p50 {res.itl_p50_ms:.0f} ms")
    return runs, timings


def run_poisson(live: dict, workload: Workload, rates: dict[str, float], dtype: str, load: float | None,
                failures: dict[str, str] | None = None) -> dict:
    failures = {} if failures is None else failures
    out = {}
    for name, rate in rates.items():
        done = name in live and guarded(live, failures, name, run_one, live[name], name, dtype,
                                        with_poisson_arrivals(workload, rate))
        if not done:
            continue
        res = done[0]
        out[name] = {**res.to_dict(), "rate_req_s": rate, "load": load}
        log(f"[{dtype}] poisson {rate:.2f} req/s {name}: {res.output_tok_s:.1f} out tok/s, "
            f"TTFT p50 {res.ttft_p50_s:.2f} s")
    return out


def _own_rate_runs(live: dict, workload: Workload, runs: dict, plan: PhasePlan, dtype: str,
                   failures: dict[str, str]) -> dict:
    if plan.poisson_load <= 0:
        return {}
    n = len(workload.requests)
    rates = {name: plan.poisson_load * saturation_rate(median_result(runs[name]), n) for name in live
             if name not in NO_ARRIVALS and runs.get(name)}
    return run_poisson(live, workload, rates, dtype, plan.poisson_load, failures)


def _common_rate_runs(live: dict, workload: Workload, rate: float, dtype: str, failures: dict[str, str]) -> dict:
    return run_poisson(live, workload, {m: rate for m in live if m not in NO_ARRIVALS}, dtype, None, failures)


def mem_available_gib() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def footprint_gib(name: str) -> float:
    return next((v for k, v in FOOTPRINT_GIB.items() if name.startswith(k)), 2.0)


def start_wave(names: list[str], spec: drivers.DriverSpec, live: dict,
               failures: dict[str, str] | None = None) -> list[str]:
    """Starts systems in order while the next one fits (at least one), filling `live` as they come up so the
    caller's `finally` also stops a partial start; returns the systems left for a later wave. A system that fails
    to start is noted in `failures` and skipped."""
    failures = {} if failures is None else failures
    for i, name in enumerate(names):
        free = mem_available_gib()
        if live and free - footprint_gib(name) < MARGIN_GIB:
            log(f"[{spec.dtype}] {free:.1f} GiB free: {', '.join(names[i:])} run in a later wave")
            return names[i:]
        log(f"[{spec.dtype}] starting {name} ({free:.1f} GiB free)")
        driver = guarded(live, failures, name, drivers.start, name, spec)
        if driver is not None:
            live[name] = driver
    return []


def _close(live: dict) -> None:
    for driver in live.values():
        driver.close()


def _measure_wave(live: dict, workload: Workload, plan: PhasePlan, dtype: str, res: PhaseResults) -> None:
    runs, timings = run_repeats(live, workload, plan.repeats, dtype, failures=res.failures)
    res.runs.update({n: rs for n, rs in runs.items() if rs}), res.timings.update(timings)
    res.poisson.update(_own_rate_runs(live, workload, runs, plan, dtype, res.failures))
    if plan.contention:
        with busy_core() as core:
            log(f"[{dtype}] contention: one busy process pinned to core {core}")
            contended = run_repeats(live, workload, plan.repeats, dtype, " contended", res.failures, 1.0)[0]
            res.contended.update({n: rs for n, rs in contended.items() if rs and n in res.runs})


def _waves(names: list[str], spec: drivers.DriverSpec, workload: Workload, plan: PhasePlan, res: PhaseResults,
           live: dict) -> list[list[str]]:
    """Measures wave after wave; the last wave stays running in `live` (the common-rate run may reuse it)."""
    pending, waves = list(names), []
    while pending:
        _close(live)
        live.clear()
        pending = start_wave(pending, spec, live, res.failures)
        waves.append(list(live))
        _measure_wave(live, workload, plan, spec.dtype, res)
    return waves


def _common(waves: list[list[str]], spec: drivers.DriverSpec, workload: Workload, plan: PhasePlan,
            res: PhaseResults, live: dict) -> None:
    medians = {n: median_result(rs) for n, rs in res.runs.items()}
    rate = choose_common_rate(medians, len(workload.requests), plan.poisson_load, plan.common_rate)
    if rate is None:
        return
    rule = "given" if plan.common_rate else f"{plan.poisson_load:.0%} of the slowest system's saturation rate"
    res.poisson_common = {"rate_req_s": rate, "rule": rule, "results": {}}
    for wave in waves if len(waves) > 1 else [waves[0]]:
        if len(waves) > 1:
            _close(live)
            live.clear()
            left = start_wave(wave, spec, live, res.failures)
            if left:
                log(f"[{spec.dtype}] no common-rate run for {', '.join(left)}: memory is shorter than before")
        res.poisson_common["results"].update(_common_rate_runs(live, workload, rate, spec.dtype, res.failures))


def run_systems(names: list[str], spec: drivers.DriverSpec, workload: Workload, plan: PhasePlan) -> PhaseResults:
    """All systems of the dtype in one wave when memory allows (the common-rate Poisson run then reuses it);
    otherwise wave by wave, and the common rate, known only once every system was measured, restarts them.
    Whatever is running is stopped on the way out, also on an exception or SIGTERM (SystemExit)."""
    res = PhaseResults({}, {}, {}, {}, {})
    live: dict[str, drivers.Driver] = {}
    try:
        waves = _waves(names, spec, workload, plan, res, live)
        _common(waves, spec, workload, plan, res, live)
    finally:
        _close(live)
    return res
