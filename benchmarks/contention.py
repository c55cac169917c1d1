"""pagedserve's in-process throughput when a core is taken away: the measurement behind the thread/wait policy.

For each compute-thread count and OpenMP wait policy it runs benchmarks/throughput.py (pagedserve only, one seeded
workload) on a quiet machine and again beside one CPU-bound process pinned to the last usable core, and prints one
JSON line per run plus a summary with each setting's contended/quiet ratio (a fair share on 2 cores is 0.5x).
Run it on an otherwise idle machine; the load average before and after is in the output.

    python benchmarks/contention.py                       # threads 2 and 1, ACTIVE and PASSIVE waits
    python benchmarks/contention.py --threads 2 --waits PASSIVE --num-requests 16
    python benchmarks/contention.py --threads 0 --waits GOVERNED PASSIVE  # as `pagedserve serve` runs
    python benchmarks/contention.py --cpu-quota 1.5 --threads 2 1 0 --waits ACTIVE PASSIVE  # a container limit (root)

--cpu-quota CPUS replaces the busy process with a CFS quota: the measured process runs in a fresh cgroup (v2 cpu.max,
else v1 cpu.cfs_quota_us) allowed CPUS per 100 ms period, as a container CPU limit does; its throttling counters are
in the output. `--threads 0` then takes the engine's own count, which follows the quota (engine/host/cpu_threads.py).

GOVERNED: OMP_WAIT_POLICY unset (libgomp spins a while, then sleeps) with the engine's thread governor, which needs
the engine to choose its own thread count: pair it with `--threads 0`. SPIN<N>: the policy unset and
GOMP_SPINCOUNT=N (poll N times, then sleep; what `pagedserve serve` sets under a quota), also governed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from pagedserve.engine.host.cpu_threads import CGROUP_ROOT, OPENMP_WAIT_VARS

HERE = Path(__file__).resolve().parent
BUSY_LOOP = "while True: pass"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


@contextmanager
def busy_core():
    """One CPU-bound process pinned to the last usable core for the duration of the block (yields that core);
    the system measured may still schedule threads there. Killed on exit, also when the block raises."""
    core = sorted(os.sched_getaffinity(0))[-1]
    busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        yield core
    finally:
        busy.kill()
        busy.wait()


def wait_for_quiet_cpus(busy_below: float, max_wait_s: float = 20.0, window_s: float = 0.5) -> tuple[float, float]:
    """Wait until the usable CPUs are idle (other processes busy below `busy_below` CPUs over one `window_s`), at
    most `max_wait_s`; returns (seconds waited, busy CPUs in the last window). Why: a system that just finished a run
    keeps its threads spinning for a while (OpenMP spin-waits, a peer's busy-polling engine loop), and the next
    system measured would start beside them: pagedserve's thread governor (engine/host/thread_governor.py) then
    steps down to one thread for its first prefill steps, and a peer without one shares its cores. Each run starts
    on quiet cores, as each would in its own deployment."""
    from pagedserve.engine.host.thread_governor import read_sample

    cpus = frozenset(os.sched_getaffinity(0))
    start = time.monotonic()
    while True:
        before = read_sample(cpus)
        time.sleep(window_s)
        after = read_sample(cpus)
        busy = ((after.busy_s - before.busy_s) - (after.own_s - before.own_s)) / (after.wall_s - before.wall_s)
        waited = time.monotonic() - start
        if busy < busy_below or waited >= max_wait_s:
            return waited, busy


PERIOD_US = 100_000


class QuotaCgroup:
    """A fresh cgroup with a CFS CPU quota; `enter` (a preexec_fn) moves the calling process into it."""

    def __init__(self, cpus: float) -> None:
        controllers = CGROUP_ROOT / "cgroup.controllers"
        v2 = controllers.exists() and "cpu" in controllers.read_text().split()
        self.path = (CGROUP_ROOT if v2 else CGROUP_ROOT / "cpu") / f"pagedserve-contention-{os.getpid()}"
        quota = str(round(cpus * PERIOD_US))
        try:
            self.path.mkdir()
            if v2:
                (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(quota)
        except OSError as exc:
            if self.path.exists():  # made, but its quota refused: leave no stray cgroup behind
                self.path.rmdir()
            raise SystemExit(f"--cpu-quota needs a writable cgroup cpu controller (root): {exc}") from exc

    def enter(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def throttling(self) -> dict:
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        throttled_s = int(stat["throttled_usec"]) / 1e6 if "throttled_usec" in stat else int(stat["throttled_time"]) / 1e9
        return {"periods": int(stat["nr_periods"]), "throttled_periods": int(stat["nr_throttled"]),
                "throttled_s": throttled_s}

    def remove(self) -> None:
        self.path.rmdir()


@contextmanager
def _pressure(args: argparse.Namespace, contended: bool):
    """Yields (preexec_fn, cgroup or None) for the measured process: none, a busy core beside it, or a quota."""
    if not contended:
        yield None, None
    elif args.cpu_quota is None:
        with busy_core():
            yield None, None
    else:
        group = QuotaCgroup(args.cpu_quota)
        try:
            yield group.enter, group
        finally:
            group.remove()


def wait_setting(text: str) -> str:
    if text in ("ACTIVE", "PASSIVE", "GOVERNED") or (text.startswith("SPIN") and text[4:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"unknown wait {text!r}; supported: ACTIVE, PASSIVE, GOVERNED, SPIN<N>")


def run_once(args: argparse.Namespace, threads: int, wait: str, contended: bool) -> dict:
    throttling = None
    with _pressure(args, contended) as (preexec, group):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, str(HERE / "throughput.py"), "--systems", "pagedserve", "--threads", str(threads),
                   "--repeats", str(args.repeats), "--no-roofline", "--num-requests", str(args.num_requests),
                   "--prompt-len", *map(str, args.prompt_len), "--output-len", *map(str, args.output_len),
                   "--dtype", args.dtype, "--out", out.name]
            env = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT_VARS}
            if wait.startswith("SPIN"):
                env["GOMP_SPINCOUNT"] = wait[4:]
            elif wait != "GOVERNED":
                env["OMP_WAIT_POLICY"] = wait
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env, preexec_fn=preexec)
            median = json.loads(Path(out.name).read_text())["results"][args.dtype]["median"]["pagedserve"]
            throttling = group.throttling() if group else None
    pressure = ("cpu_quota" if args.cpu_quota is not None else "busy_core") if contended else None
    return {"benchmark": "contention", "threads": threads, "omp_wait_policy": wait, "contended": contended,
            "pressure": pressure, "cpu_quota": args.cpu_quota if contended else None, "throttling": throttling,
            "output_tok_s": median["output_tok_s"], "ttft_p50_s": median["ttft_p50_s"],
            "itl_p50_ms": median["itl_p50_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--waits", nargs="+", default=["ACTIVE", "PASSIVE"], type=wait_setting,
                        help="ACTIVE, PASSIVE, GOVERNED or SPIN<N> (GOMP_SPINCOUNT=N, the policy unset)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(64, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 64))
    parser.add_argument("--cpu-quota", type=float, default=None,
                        help="CPUs per period for the contended runs, instead of a busy core (needs root)")
    args = parser.parse_args()
    if args.cpu_quota is not None and args.cpu_quota <= 0:
        parser.error("--cpu-quota must be > 0")
    print(json.dumps({"benchmark": "contention_setup", "cpu": cpu_model(),
                      "usable_cores": len(os.sched_getaffinity(0)), "load_avg_before": os.getloadavg()[0],
                      "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                                   "output_len": args.output_len, "dtype": args.dtype},
                      "pressure": "busy_core" if args.cpu_quota is None else f"cpu_quota {args.cpu_quota:g}"}), flush=True)
    summary = {}
    for threads in args.threads:
        for wait in args.waits:
            quiet = run_once(args, threads, wait, contended=False)
            busy = run_once(args, threads, wait, contended=True)
            print(json.dumps(quiet), flush=True)
            print(json.dumps(busy), flush=True)
            summary[f"threads{threads}_{wait.lower()}"] = {
                "quiet_tok_s": quiet["output_tok_s"], "contended_tok_s": busy["output_tok_s"],
                "contended_vs_quiet": busy["output_tok_s"] / quiet["output_tok_s"]}
    print(json.dumps({"benchmark": "contention_summary", "load_avg_after": os.getloadavg()[0], **summary}))


if __name__ == "__main__":
    main()
