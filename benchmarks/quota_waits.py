"""`pagedserve serve` under a container CPU limit, for each OpenMP wait setting: the measurement behind the entry's
choice (service/entry.py) of how compute threads wait under a quota.

Each setting starts the OpenAI HTTP server as a user would run it (the model, `--dtype auto`) in a fresh cgroup with a
CFS quota of `--quotas` CPUs per 100 ms period (what a Kubernetes CPU limit sets), and drives it from outside the
cgroup (the client is another service) with `--streams` concurrent requests of 64 random token ids ->
`--output-len` tokens, best of `--repeats`; each line also carries the cgroup's throttled time and the server's log
line of its threads and wait setting. The server loads inside the quota too, so its entry sees the limit. Needs root
(a writable cgroup cpu controller) and a quiet machine: the load average before and after is in the output.

    sudo python benchmarks/quota_waits.py                                       # default model, quota 1.5 and 2
    sudo python benchmarks/quota_waits.py --models gemma-3-270m --quotas 1.25 --streams 4 16

Settings (`--waits`): PASSIVE and ACTIVE (OMP_WAIT_POLICY), DEFAULT (libgomp's own: spin ~300000 iterations, then
sleep), SPIN<N> (GOMP_SPINCOUNT=N with the policy unset: spin N iterations, then sleep), and ENTRY (nothing set:
what the server's entry chooses for the quota it finds, as shipped). Models: the embedded GGUF names
(`resolve_model`), or a path (an HF folder or a .gguf file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "peers"), str(HERE)]

import host_record  # noqa: E402
import servers  # noqa: E402
from contention import QuotaCgroup  # noqa: E402
from http_client import Endpoint, run_http  # noqa: E402
from metrics import summarize  # noqa: E402
from workload import WorkloadConfig, build_workload  # noqa: E402

from pagedserve.engine.host.cpu_threads import OPENMP_WAIT_VARS  # noqa: E402

WARMUP = WorkloadConfig(num_requests=4, prompt_len_min=16, prompt_len_max=48, output_len_min=4, output_len_max=8,
                        seed=99)
WAITS_HELP = "PASSIVE, ACTIVE, DEFAULT, ENTRY or SPIN<N>"


def wait_env(wait: str) -> dict[str, str]:
    """The OpenMP variables a setting puts in the server's environment (every other one is removed)."""
    if wait in ("PASSIVE", "ACTIVE"):
        return {"OMP_WAIT_POLICY": wait}
    if wait in ("DEFAULT", "ENTRY"):
        return {}
    if wait.startswith("SPIN") and wait[4:].isdigit():
        return {"GOMP_SPINCOUNT": wait[4:]}
    raise ValueError(f"unknown wait setting {wait!r}; supported: {WAITS_HELP}")


def model_path(name: str) -> str:
    if name and Path(name).exists():
        return name
    from pagedserve.engine.loading.model_store import resolve_model

    return str(resolve_model(name or None).weights)


def server_env(wait: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT_VARS}
    env.update(wait_env(wait))
    if wait == "DEFAULT":
        # The entry would pick a setting under the quota; an explicit spin count of libgomp's own default stops it.
        env["GOMP_SPINCOUNT"] = "300000"
    return env


def measure(model: str, quota: float, wait: str, streams: list[int], output_len: int, repeats: int,
            log_dir: Path) -> None:
    """Prints one JSON line per stream count."""
    group = QuotaCgroup(quota)
    try:
        server = start_in(group, model, wait, log_dir)
        try:
            serve_rows(server, group, model, quota, wait, streams, output_len, repeats)
        finally:
            server.stop(timeout=10)
            time.sleep(0.5)  # the cgroup empties once the process is reaped
    finally:
        group.remove()


def start_in(group: QuotaCgroup, model: str, wait: str, log_dir: Path) -> servers.Server:
    """The server started inside the quota (its entry reads it); the client, this process, stays out of it."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(server_env(wait))  # start_pagedserve passes this process's environment on
    group.enter()
    try:
        return servers.start_pagedserve(model, "auto", log_dir, http=True, extra_args=("--log-level", "INFO"))
    finally:
        (group.path.parent / "cgroup.procs").write_text(str(os.getpid()))
        os.environ.clear()
        os.environ.update(saved)


def serve_rows(server: servers.Server, group: QuotaCgroup, model: str, quota: float, wait: str, streams: list[int],
               output_len: int, repeats: int) -> None:
    endpoint = Endpoint(server.target + "/v1/completions", "model", (("return_token_ids", True),))
    # The log file collects every start of the same name: this server's line is the last one.
    threads_line = next((line for line in reversed(server.log_path.read_text().splitlines())
                         if "compute thread(s)" in line), None)
    run_http(endpoint, build_workload(WARMUP))
    for n in streams:
        before = group.throttling()
        runs = [run_once(endpoint, n, output_len, seed) for seed in range(repeats)]
        after = group.throttling()
        best = max(runs, key=lambda r: r.output_tok_s)
        row = {"benchmark": "quota_waits", "model": Path(model).name, "quota_cpus": quota, "wait": wait,
               "streams": n, "output_len": output_len, "output_tok_s": round(best.output_tok_s, 1),
               "runs_tok_s": [round(r.output_tok_s, 1) for r in runs],
               "itl_p50_ms": round(best.itl_p50_ms, 2), "ttft_p50_s": round(best.ttft_p50_s, 3),
               "throttled_s": round(after["throttled_s"] - before["throttled_s"], 2),
               "throttled_periods": after["throttled_periods"] - before["throttled_periods"],
               "server_threads_log": threads_line}
        print(json.dumps(row), flush=True)


def run_once(endpoint: Endpoint, streams: int, output_len: int, seed: int):
    workload = build_workload(WorkloadConfig(num_requests=streams, prompt_len_min=64, prompt_len_max=64,
                                             output_len_min=output_len, output_len_max=output_len, seed=4321 + seed))
    return summarize("pagedserve-http", "auto", run_http(endpoint, workload), prompt_tokens=64 * streams)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=[""], help="embedded model names or paths ('' the default)")
    parser.add_argument("--quotas", type=float, nargs="+", default=[1.5, 2.0])
    parser.add_argument("--waits", nargs="+", default=["PASSIVE", "DEFAULT", "ENTRY"], help=WAITS_HELP)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pagedserve-quota-waits"))
    args = parser.parse_args()
    for wait in args.waits:
        wait_env(wait)  # an unknown setting fails before any server starts
    if min(args.quotas) <= 0:
        parser.error("--quotas must be > 0")
    print(json.dumps({"benchmark": "quota_waits_setup", "cpu": host_record.cpu_model(),
                      "usable_cores": len(os.sched_getaffinity(0)), "isa": host_record.pagedserve_isa("native"),
                      "load_avg_before": os.getloadavg()}), flush=True)
    for model in args.models:
        for quota in args.quotas:
            for wait in args.waits:
                measure(model_path(model), quota, wait, args.streams, args.output_len, args.repeats, args.log_dir)
    print(json.dumps({"benchmark": "quota_waits_done", "load_avg_after": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
