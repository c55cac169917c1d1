"""The whole side-by-side comparison in one command (never in CI):

    benchmarks/peers/setup.sh                       # once: vLLM venv, llama-server, GGUF files
    python benchmarks/peers/compare.py              # fp32 + bf16, 3 interleaved repeats, Poisson runs
    python benchmarks/peers/compare.py --quick      # a few minutes, a smoke test of the harness

For each dtype and each mode (in-process, then over the wire) it starts every system,
warms it up, runs the identical seeded workload through them in a rotating order
`--repeats` times, then one Poisson-arrival run per system at `--poisson-load` times
that system's measured saturation rate; medians, ratios and a roofline entry go to
JSON, and report.py renders docs/benchmarks.md (+ a PNG plot).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from metrics import median_result, ratios, summarize, token_agreement  # noqa: E402
from roofline import measure_peaks, roofline_entry, useful_flops  # noqa: E402
from workload import QUICK, WorkloadConfig, add_workload_args, build_workload, workload_config_from_args  # noqa: E402

import drivers  # noqa: E402
import paths  # noqa: E402
import report  # noqa: E402

REPO = HERE.parent.parent
# (ours, theirs) pairs whose ratios the issue asks for; like is compared with like.
PAIRS = [("pagedserve", "vllm"), ("pagedserve", "vllm-allcores"), ("pagedserve", "hf_cb"), ("pagedserve", "hf_static"),
         ("pagedserve", "llama-server"), ("pagedserve", "vllm-http"),
         ("pagedserve-grpc", "vllm-http"), ("pagedserve-grpc", "llama-server"),
         ("pagedserve-grpc", "pagedserve"), ("pagedserve-http", "vllm-http"), ("pagedserve-http", "pagedserve-grpc")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--systems", nargs="+", default=list(drivers.SYSTEMS), choices=list(drivers.SYSTEMS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="compute threads for pagedserve, transformers and llama-server (vLLM: --vllm-bind); "
                        "default: every core. Use 1 when other jobs share the machine: a 2-thread OpenMP pool "
                        "collapses whenever another process takes a core (see docs/benchmarks.md)")
    p.add_argument("--poisson-load", type=float, default=0.9, help="0 disables the Poisson runs")
    p.add_argument("--vllm-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND for vLLM")
    p.add_argument("--quick", action="store_true",
                   help="16 small requests, 1 repeat, no Poisson; writes under the log dir unless --out-* are given")
    p.add_argument("--out-json", type=Path, default=None, help="default: docs/benchmarks.json")
    p.add_argument("--out-md", type=Path, default=None, help="default: docs/benchmarks.md")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="default: <peers cache>/logs (see paths.py)")
    return p.parse_args()


def source_version() -> str:
    """The commit measured (read-only git query), with '+dirty' when the tree has edits."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain") else "")


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, file=sys.stderr, flush=True)


_ISA = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


def host_info() -> dict:
    """CPU model, the ISA flags that decide kernel paths, usable cores and the load average: ratios are only
    comparable within one run on one host, so every result file says which host that was."""
    info = {"cpu_model": "unknown", "isa": [], "usable_cores": len(os.sched_getaffinity(0)),
            "load_avg_1m_start": os.getloadavg()[0]}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            info["cpu_model"] = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            info["isa"] = [f for f in _ISA if f in flags]
            break
    return info


def check_token_counts(name: str, timings: list, workload) -> None:
    """Every system must generate exactly the workload's tokens (ignore_eos): a server that truncates (llama-server's
    fixed slot context answers HTTP 200 with fewer tokens) would otherwise be scored on less work."""
    expected = sum(r.max_tokens for r in workload.requests)
    got = sum(t.num_output_tokens for t in timings)
    if len(timings) != len(workload.requests) or got != expected:
        raise SystemExit(f"{name}: {len(timings)} requests / {got} output tokens, the workload has "
                         f"{len(workload.requests)} / {expected}; its results would not be comparable")


def run_phase(names: list[str], spec: drivers.DriverSpec, config: WorkloadConfig, repeats: int,
              poisson_load: float) -> tuple[dict, dict, dict]:
    """Starts the systems of one mode, interleaves the repeats, then the Poisson runs."""
    live: dict[str, drivers.Driver] = {}
    runs: dict[str, list] = {n: [] for n in names}
    timings: dict[str, list] = {}
    poisson: dict[str, dict] = {}
    workload = build_workload(config)
    prompt_tokens = workload.num_prompt_tokens
    try:
        for name in names:
            log(f"[{spec.dtype}] starting {name}")
            live[name] = drivers.start(name, spec)
        for rep in range(repeats):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                t, peak, extra = live[name].run(config)
                check_token_counts(name, t, workload)
                res = summarize(name, spec.dtype, t, prompt_tokens, peak, extra)
                runs[name].append(res)
                timings[name] = t
                log(f"[{spec.dtype}] rep {rep + 1} {name}: {res.output_tok_s:.1f} out tok/s, "
                    f"TTFT p50 {res.ttft_p50_s:.2f} s, ITL p50 {res.itl_p50_ms:.0f} ms")
        for name in names if poisson_load > 0 else []:
            if name == "hf_static":  # one padded batch has no notion of arrivals
                continue
            med = median_result(runs[name])
            rate = poisson_load * config.num_requests / med["duration_s"]
            pconfig = dataclasses.replace(config, arrival="poisson", rate=rate)
            t, peak, extra = live[name].run(pconfig)
            check_token_counts(name, t, workload)
            res = summarize(name, spec.dtype, t, prompt_tokens, peak, extra).to_dict()
            poisson[name] = {**res, "rate_req_s": rate, "load": poisson_load}
            log(f"[{spec.dtype}] poisson {rate:.2f} req/s {name}: {res['output_tok_s']:.1f} out tok/s, "
                f"TTFT p50 {res['ttft_p50_s']:.2f} s")
    finally:
        for name, driver in live.items():
            driver.close()
    return runs, timings, poisson


def run_dtype(args, spec: drivers.DriverSpec, config: WorkloadConfig, repeats: int, flops: float,
              peaks: dict) -> dict:
    runs, timings, poisson = {}, {}, {}
    for mode in ("in-process", "wire"):
        names = [n for n in args.systems if drivers.SYSTEMS[n][0] == mode]
        if names:
            r, t, p = run_phase(names, spec, config, repeats, 0 if args.quick else args.poisson_load)
            runs.update(r), timings.update(t), poisson.update(p)
    medians = {n: median_result(rs) for n, rs in runs.items()}
    section = {"median": medians, "runs": {n: [r.to_dict() for r in rs] for n, rs in runs.items()},
               "poisson": poisson, "ratios": {}, "token_agreement": {}}
    for ours, theirs in PAIRS:
        section["ratios"].update(ratios(medians, ours, [theirs]))
        if ours in timings and theirs in timings:
            section["token_agreement"][f"{ours}_vs_{theirs}"] = token_agreement(timings[ours], timings[theirs])
    if peaks:
        section["roofline"] = {n: roofline_entry(flops, m["duration_s"], peaks, spec.dtype)
                               for n, m in medians.items()}
    return section


def _exit_on_sigterm(signum, frame) -> None:
    # SystemExit unwinds through run_phase's `finally`, which stops every server this run started;
    # the default SIGTERM action would orphan them (they keep the cores busy for the next run).
    sys.exit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parse_args()
    args.log_dir = args.log_dir or paths.peers_cache() / "logs"
    # A smoke run must never overwrite the published figures.
    out_dir = args.log_dir if args.quick else REPO / "docs"
    out_dir.mkdir(parents=True, exist_ok=True)
    args.out_json = args.out_json or out_dir / ("benchmarks-quick.json" if args.quick else "benchmarks.json")
    args.out_md = args.out_md or out_dir / ("benchmarks-quick.md" if args.quick else "benchmarks.md")
    from hf_folder import hf_folder

    model_dir = str(hf_folder(args.model))  # vLLM and the transformers baselines read HF folders only
    config = QUICK if args.quick else workload_config_from_args(args)
    repeats = 1 if args.quick else args.repeats
    workload = build_workload(config)
    flops = useful_flops(model_dir, workload)
    log("measuring the matmul peak (1 and 2 threads, fp32 and bf16)")
    peaks = measure_peaks((1, 2))
    out = {"meta": {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "model": model_dir, "host": host_info(),
                    "pagedserve_version": source_version(),
                    "workload": workload.summary(), "repeats": repeats, "threads": args.threads,
                    "vllm_bind": args.vllm_bind, "useful_tflop": flops / 1e12, "matmul_peak_gflops": peaks,
                    "systems": {n: drivers.SYSTEMS[n][0] for n in args.systems}, "quick": args.quick},
           "results": {}}
    for dtype in args.dtypes:
        spec = drivers.DriverSpec(model_dir, dtype, args.threads, args.log_dir, args.vllm_bind)
        out["results"][dtype] = run_dtype(args, spec, config, repeats, flops, peaks)
        args.out_json.write_text(json.dumps(out, indent=2))  # partial results survive a crash
    out["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    out["meta"]["host"]["load_avg_1m_end"] = os.getloadavg()[0]
    args.out_json.write_text(json.dumps(out, indent=2))
    report.write_report(out, args.out_md, args.out_json)
    log(f"wrote {args.out_json} and {args.out_md}")


if __name__ == "__main__":
    main()
