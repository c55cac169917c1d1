"""In-process throughput: pagedserve vs transformers (static padded generate and
continuous batching) on one seeded workload, in one run, interleaved and repeated.

    python benchmarks/throughput.py                      # issue 7's workload, fp32
    python benchmarks/throughput.py --dtype float32 bfloat16 --repeats 3 --out /tmp/tp.json
    python benchmarks/throughput.py --quick              # a small smoke run (~1-2 min)
    python benchmarks/throughput.py --arrival poisson --rate 4

Prints one JSON document: per system and dtype the median output tok/s, TTFT p50/p99,
inter-token latency p50/p99, peak KV blocks, a roofline entry, and the ratios of
pagedserve to each baseline. Never run in CI or tests (it takes minutes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from metrics import median_result, ratios, summarize, token_agreement  # noqa: E402
from roofline import measure_peaks, roofline_entry, useful_flops  # noqa: E402
from systems import SYSTEMS, SystemSpec, create_system  # noqa: E402
from workload import QUICK, Workload, add_workload_args, build_workload, workload_config_from_args  # noqa: E402

OURS = "pagedserve"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="compute threads per system (default: every core; 1 on shared cores, see docs/benchmarks.md; "
                             "0: pagedserve picks its own, with its thread governor)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="keep prefix caches on (repeats then hit the cache of earlier repeats)")
    parser.add_argument("--quick", action="store_true", help="16 small requests, 1 repeat")
    parser.add_argument("--no-roofline", action="store_true", help="skip measuring the matmul peak")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_dtype(names: list[str], spec: SystemSpec, workload: Workload, repeats: int) -> dict:
    """Loads and warms every system, then runs them in a rotating order per repeat,
    so slow drift on a shared machine spreads over all systems alike."""
    systems = {}
    for name in names:
        log(f"[{spec.dtype}] loading + warming {name}")
        systems[name] = create_system(name, spec)
    runs: dict[str, list] = {n: [] for n in names}
    timings: dict[str, list] = {}
    for rep in range(repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            r = systems[name].run(workload)
            res = summarize(name, spec.dtype, r.timings, workload.num_prompt_tokens, r.peak_kv_blocks, r.extra)
            runs[name].append(res)
            timings[name] = r.timings
            log(f"[{spec.dtype}] rep {rep + 1}/{repeats} {name}: {res.output_tok_s:.1f} out tok/s, "
                f"TTFT p50 {res.ttft_p50_s:.2f} s, ITL p50 {res.itl_p50_ms:.1f} ms")
    del systems
    gc.collect()
    agreement = {f"{OURS}_vs_{n}": token_agreement(timings[OURS], timings[n])
                 for n in names if n != OURS and OURS in timings}
    return {"runs": {n: [r.to_dict() for r in rs] for n, rs in runs.items()},
            "median": {n: median_result(rs) for n, rs in runs.items()},
            "token_agreement": agreement}


def add_roofline(section: dict, flops: float, peaks: dict[str, float], dtype: str) -> None:
    section["roofline"] = {n: roofline_entry(flops, m["duration_s"], peaks, dtype)
                           for n, m in section["median"].items()}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from hf_folder import hf_folder

    model_dir = str(hf_folder(args.model))  # the transformers baselines read HF folders only
    config = QUICK if args.quick else workload_config_from_args(args)
    repeats = 1 if args.quick else args.repeats
    workload = build_workload(config)
    flops = useful_flops(model_dir, workload)
    report = {"workload": workload.summary(), "model": model_dir, "threads": args.threads,
              "useful_tflop": flops / 1e12, "results": {}}
    peaks = {} if args.no_roofline else measure_peaks(tuple(sorted({1, args.threads})))
    report["matmul_peak_gflops"] = peaks
    for dtype in args.dtype:
        spec = SystemSpec(model_dir, dtype, args.threads, args.prefix_caching)
        section = run_dtype(args.systems, spec, workload, repeats)
        others = [n for n in args.systems if n != OURS]
        section["ratios"] = ratios(section["median"], OURS, others)
        if peaks:
            add_roofline(section, flops, peaks, dtype)
        report["results"][dtype] = section
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return report


if __name__ == "__main__":
    main()
