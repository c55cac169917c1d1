"""The whole side-by-side comparison in one command (never in CI):

    benchmarks/peers/setup.sh                       # once: vLLM venv, llama-server, GGUF files
    python benchmarks/peers/compare.py              # fp32 + bf16, 3 interleaved repeats, Poisson runs
    python benchmarks/peers/compare.py --quick      # a few minutes, a smoke test of the harness

For each dtype it starts every system (in-process workers and servers together, phases.py),
warms them up, runs the identical workload (seeded, or --workload-file) through them in a
rotating order `--repeats` times, then one Poisson-arrival run per system at `--poisson-load`
times that system's measured saturation rate and one run of every system at one common rate
(--poisson-common-rate); with --contention the repeats run again beside a busy core. Medians,
ratios and a roofline entry go to JSON, and report.py renders docs/benchmarks.md (+ a PNG plot).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from metrics import median_result, ratios, token_agreement  # noqa: E402
from roofline import measure_peaks, roofline_entry, useful_flops  # noqa: E402
from workload import QUICK, Workload, add_workload_args, build_workload, workload_config_from_args  # noqa: E402
from workload_file import dump_workload, load_workload  # noqa: E402

import drivers  # noqa: E402
import paths  # noqa: E402
import phases  # noqa: E402
import low_concurrency  # noqa: E402
import report  # noqa: E402
import servers  # noqa: E402

REPO = HERE.parent.parent
# (ours, theirs) pairs whose ratios the issue asks for; like is compared with like.
PAIRS = [("pagedserve", "vllm"), ("pagedserve", "vllm-allcores"), ("pagedserve", "vllm-preload"),
         ("pagedserve", "vllm-allcores-preload"), ("pagedserve", "hf_cb"), ("pagedserve", "hf_static"),
         ("pagedserve", "llama-server"), ("pagedserve", "vllm-http"),
         ("pagedserve-grpc", "vllm-http"), ("pagedserve-grpc", "vllm-http-preload"), ("pagedserve-grpc", "llama-server"),
         ("pagedserve-grpc", "pagedserve"), ("pagedserve-http", "vllm-http"), ("pagedserve-http", "vllm-http-preload"),
         ("pagedserve-http", "pagedserve-grpc")]


DEFAULT_SYSTEMS = [n for n in drivers.SYSTEMS if n != "vllm-preload"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS, choices=list(drivers.SYSTEMS),
                   help="default: all but vllm-preload (vLLM's default binding computes on one core here, so its "
                        "preloaded twin is never its best variant, and every system of a dtype is resident at once)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="compute threads for pagedserve, transformers and llama-server (vLLM: --vllm-bind); "
                        "default: every core. Use 1 when other jobs share the machine: a 2-thread OpenMP pool "
                        "collapses whenever another process takes a core (see docs/benchmarks.md)")
    p.add_argument("--poisson-load", type=float, default=0.9, help="0 disables the Poisson runs")
    p.add_argument("--poisson-common-rate", type=float, default=None, metavar="R",
                   help="req/s of the Poisson run every system gets at the same rate (default: --poisson-load x "
                        "the slowest system's saturation rate within the dtype; 0 disables)")
    p.add_argument("--contention", action="store_true",
                   help="run each system's repeats again beside one busy process pinned to the last usable core")
    p.add_argument("--workload-file", type=Path, default=None,
                   help="JSONL workload, one request a line (see docs/benchmarks.md); replaces the seeded one")
    p.add_argument("--dump-workload", type=Path, default=None, metavar="F",
                   help="write the workload in the --workload-file format to F and exit")
    p.add_argument("--vllm-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND for vLLM")
    p.add_argument("--pagedserve-dtype", choices=["auto", "bfloat16", "float32"], default=None,
                   help="pagedserve's --dtype in every section instead of the section's (e.g. auto: fp32 compute over "
                        "a bf16 checkpoint's weights on a host without bf16 arithmetic, the products of the peers' "
                        "float32); the peers keep the section's dtype")
    p.add_argument("--tier", choices=servers.TIERS, default="native",
                   help="avx2: pagedserve's AVX2 kernels (PAGEDSERVE_CPU_ISA), vLLM's AVX2 library with torch and "
                        "oneDNN capped at AVX2, llama.cpp's avx2 build: an AVX2-only host measured on any host "
                        "(the vLLM-http systems are not forced)")
    p.add_argument("--quick", action="store_true",
                   help="16 small requests, 1 repeat, no Poisson; writes under the log dir unless --out-* are given")
    p.add_argument("--no-low-concurrency", action="store_true",
                   help="skip the low-concurrency section (1-8 streams on a GGUF file; low_concurrency.py)")
    p.add_argument("--low-concurrency-only", action="store_true", help="run only the low-concurrency section")
    low_concurrency.add_args(p, prefix="lc-")
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


log = phases.log


_ISA = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


def host_info(tier: str = "native") -> dict:
    """CPU model, the ISA flags that decide kernel paths, usable cores and the load average: ratios are only
    comparable within one run on one host, so every result file says which host that was."""
    info = {"cpu_model": "unknown", "isa": [], "usable_cores": len(os.sched_getaffinity(0)),
            "load_avg_1m_start": os.getloadavg()[0], "tier": tier}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            info["cpu_model"] = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            info["isa"] = [f for f in _ISA if f in flags]
            break
    info["pagedserve_cpu_tier"] = pagedserve_tier(tier)
    return info


def pagedserve_tier(tier: str = "native") -> str:
    """The ISA tier pagedserve's CPU kernels build for in this run: the forced one, else the host's own."""
    try:
        from pagedserve.kernels.cpu import isa
    except ImportError:
        return "unknown"
    if tier != "native":
        return tier
    forced = isa.requested_tier()
    return forced.name if forced else f"native ({isa.host_tier()})"


check_token_counts = phases.check_token_counts  # kept importable under its old home


def contention_summary(runs: dict, contended: dict) -> dict:
    """quiet and contended median tok/s per system, and their ratio (a fair share on 2 cores is 0.5x)."""
    out = {}
    for name, rs in contended.items():
        quiet, busy = median_result(runs[name])["output_tok_s"], median_result(rs)["output_tok_s"]
        out[name] = {"quiet_tok_s": quiet, "contended_tok_s": busy, "contended_vs_quiet": busy / quiet}
    return out


def run_dtype(args, spec: drivers.DriverSpec, workload: Workload, plan: phases.PhasePlan, flops: float,
              peaks: dict) -> dict:
    res = phases.run_systems(list(args.systems), spec, workload, plan)
    medians = {n: median_result(rs) for n, rs in res.runs.items()}
    section = {"median": medians, "runs": {n: [r.to_dict() for r in rs] for n, rs in res.runs.items()},
               "poisson": res.poisson, "poisson_common": res.poisson_common, "ratios": {}, "token_agreement": {},
               "failures": res.failures}
    if res.contended:
        section["contention"] = contention_summary(res.runs, res.contended)
        section["contended_runs"] = {n: [r.to_dict() for r in rs] for n, rs in res.contended.items()}
    for ours, theirs in PAIRS:
        section["ratios"].update(ratios(medians, ours, [theirs]))
        if ours in res.timings and theirs in res.timings:
            section["token_agreement"][f"{ours}_vs_{theirs}"] = token_agreement(res.timings[ours], res.timings[theirs])
    if peaks:
        section["roofline"] = {n: roofline_entry(flops, m["duration_s"], peaks, spec.dtype)
                               for n, m in medians.items()}
    return section


def _exit_on_sigterm(signum, frame) -> None:
    # SystemExit unwinds through run_phase's `finally`, which stops every server this run started;
    # the default SIGTERM action would orphan them (they keep the cores busy for the next run).
    sys.exit(128 + signum)


def resolve_outputs(args) -> None:
    args.log_dir = args.log_dir or paths.peers_cache() / "logs"
    # A smoke run must never overwrite the published figures.
    out_dir = args.log_dir if args.quick else REPO / "docs"
    out_dir.mkdir(parents=True, exist_ok=True)
    args.out_json = args.out_json or out_dir / ("benchmarks-quick.json" if args.quick else "benchmarks.json")
    args.out_md = args.out_md or out_dir / ("benchmarks-quick.md" if args.quick else "benchmarks.md")


def make_workload(args) -> Workload:
    if args.workload_file:
        return load_workload(args.workload_file)
    return build_workload(QUICK if args.quick else workload_config_from_args(args))


def make_plan(args) -> phases.PhasePlan:
    if args.quick:  # a smoke test: one repeat, no Poisson runs (contention still runs when asked)
        return phases.PhasePlan(1, 0.0, 0.0, args.contention)
    return phases.PhasePlan(args.repeats, args.poisson_load, args.poisson_common_rate, args.contention)


def main() -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parse_args()
    workload = make_workload(args)
    if args.dump_workload:
        dump_workload(workload, args.dump_workload)
        log(f"wrote {len(workload.requests)} requests to {args.dump_workload}")
        return
    resolve_outputs(args)
    from hf_folder import hf_folder

    model_dir = str(hf_folder(args.model))  # vLLM and the transformers baselines read HF folders only
    plan = make_plan(args)
    warmup = build_workload(drivers.WARMUP)
    flops = useful_flops(model_dir, workload)
    log("measuring the matmul peak (1 and 2 threads, fp32 and bf16)")
    peaks = measure_peaks((1, 2))
    out = {"meta": {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "model": model_dir, "host": host_info(args.tier),
                    "pagedserve_version": source_version(),
                    "workload": workload.summary(), "repeats": plan.repeats, "threads": args.threads,
                    "vllm_bind": args.vllm_bind, "useful_tflop": flops / 1e12, "matmul_peak_gflops": peaks,
                    "systems": {n: drivers.SYSTEMS[n][0] for n in args.systems}, "quick": args.quick,
                    "contention": args.contention, "pagedserve_dtype": args.pagedserve_dtype},
           "results": {}}
    for dtype in [] if args.low_concurrency_only else args.dtypes:
        spec = drivers.DriverSpec(model_dir, dtype, args.threads, args.log_dir, args.vllm_bind,
                                  slot_tokens=servers.slot_context(workload.requests + warmup.requests),
                                  parallel=max(64, len(workload.requests)), tier=args.tier,
                                  pagedserve_dtype=args.pagedserve_dtype)
        out["results"][dtype] = run_dtype(args, spec, workload, plan, flops, peaks)
        args.out_json.write_text(json.dumps(out, indent=2))  # partial results survive a crash
    if not args.no_low_concurrency:
        lc_systems = [n for n in low_concurrency.SYSTEMS if n in args.systems or args.low_concurrency_only]
        out["low_concurrency"] = low_concurrency.run_section(
            model_dir, args.gguf or low_concurrency.model_file(args.lc_model_file)[0], lc_systems,
            (1, 2) if args.quick else tuple(args.lc_streams), args.lc_prompt_len,
            32 if args.quick else args.lc_output_len, 1 if args.quick else args.lc_repeats, args.threads,
            args.log_dir, args.vllm_bind, tier=args.tier,
            prefill_lens=() if args.quick else tuple(args.lc_prefill_lens), pagedserve_dtype=args.lc_pagedserve_dtype)
        args.out_json.write_text(json.dumps(out, indent=2))
    out["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    out["meta"]["host"]["load_avg_1m_end"] = os.getloadavg()[0]
    args.out_json.write_text(json.dumps(out, indent=2))
    report.write_report(out, args.out_md, args.out_json)
    log(f"wrote {args.out_json} and {args.out_md}")


if __name__ == "__main__":
    main()
