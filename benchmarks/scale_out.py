"""Shared-prefix workload through SMG: cache-aware over 2 replicas vs round-robin over 2 vs 1 replica.

Every configuration gets fresh `pagedserve serve` replicas (cold prefix caches) and a fresh `smg launch` in front;
clients stream /v1/chat/completions: `--prompts` long system prompts x `--users` users each, `--concurrency` at a
time, shuffled. Prints one JSON line per configuration (throughput, TTFT p50/p99, prefix-cache hit tokens and
requests per replica from the replicas' own metrics), then a summary line.

Each replica gets its own `--cores-per-replica` cores (pinned, that many compute threads, passive OpenMP waits), as
pods with CPU requests would: replicas sharing cores measure only their contention. The 1-replica row uses the same
per-replica cores, so "x2 vs 1" is what a second pod buys. The default KV budget (224 MiB, about 5k tokens of the
default model in fp32) holds about half of the 8 system prompts: one replica, or round-robin over two, must evict;
cache-aware routing lets each replica keep its half.

    python benchmarks/scale_out.py --prompts 8 --users 16 --system-words 700 --max-tokens 64 --concurrency 16
    python benchmarks/scale_out.py --prompts 2 --users 2 --system-words 40 --max-tokens 4   # smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve.engine.loading.model_store import resolve_model

MODEL = "SmolLM2-135M-Instruct"
CONFIGS = (("cache_aware", 2), ("round_robin", 2), ("cache_aware", 1))


@dataclass(frozen=True, slots=True)
class Result:
    policy: str
    replicas: int
    requests: int
    wall_s: float
    output_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    prefix_hit_tokens: float
    requests_per_replica: list[float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(workdir: Path, server_args: list[str], cores: list[int]) -> tuple[subprocess.Popen, dict]:
    ready = workdir / "ready.json"
    cmd = [sys.executable, "-m", "pagedserve.service", "serve", "--port", "0", "--metrics-port", "0",
           "--ready-file", str(ready), "--log-level", "WARNING", "--num-threads", str(len(cores)), *server_args]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=open(workdir / "server.log", "wb"), stderr=subprocess.STDOUT,
                            env=env, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    deadline = time.monotonic() + 900
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"replica failed; see {workdir / 'server.log'}")
        time.sleep(0.2)
    return proc, json.loads(ready.read_text())


def start_smg(policy: str, ports: list[int], workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    beside = Path(sys.executable).parent / "smg"
    binary = str(beside) if beside.exists() else shutil.which("smg") or "smg"
    cmd = [binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *[f"grpc://127.0.0.1:{p}" for p in ports], "--model-path", str(resolve_model(None).tokenizer_dir),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
    proc = subprocess.Popen(cmd, stdout=open(workdir / "smg.log", "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    warm = json.dumps({"model": MODEL, "prompt": "warm", "max_tokens": 1}).encode()
    for _ in range(600):
        try:
            workers = json.loads(urllib.request.urlopen(f"{base}/workers", timeout=5).read())["workers"]
            request = urllib.request.Request(f"{base}/v1/completions", warm, {"content-type": "application/json"})
            if len(workers) == len(ports) and json.loads(urllib.request.urlopen(request, timeout=60).read())["choices"]:
                return proc, base
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"smg did not register its workers; see {workdir / 'smg.log'}")


def metric(metrics_port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name + "{"))


def one_request(base: str, messages: list[dict], max_tokens: int) -> tuple[float, int]:
    """Streams one chat completion; returns (TTFT seconds, content chunks received)."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True}), {"content-type": "application/json"})
    ttft, tokens = None, 0
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: {"):
            continue
        choice = (json.loads(line[6:]).get("choices") or [{}])[0]
        if choice.get("delta", {}).get("content"):
            ttft = ttft if ttft is not None else time.perf_counter() - start
            tokens += 1
    conn.close()
    return (ttft if ttft is not None else time.perf_counter() - start), tokens


def workload(args: argparse.Namespace) -> list[list[dict]]:
    rng = random.Random(args.seed)
    words = "bread flour oven yeast crust dough butter sugar salt water knead proof bake cool slice".split()
    systems = [f"You are assistant {p}. " + " ".join(rng.choice(words) for _ in range(args.system_words))
               for p in range(args.prompts)]
    requests = [[{"role": "system", "content": s}, {"role": "user", "content": f"User {u}: what should I bake?"}]
                for s in systems for u in range(args.users)]
    rng.shuffle(requests)
    return requests


def run_config(policy: str, n: int, args: argparse.Namespace, requests: list[list[dict]]) -> Result:
    with tempfile.TemporaryDirectory(prefix="scale-out-") as tmp:
        procs, infos = [], []
        try:
            for i in range(n):
                workdir = Path(tmp, f"replica{i}")
                workdir.mkdir()
                cores = args.cores[i * args.cores_per_replica:(i + 1) * args.cores_per_replica]
                proc, info = start_replica(workdir, args.server_args, cores)
                procs.append(proc)
                infos.append(info)
            smg, base = start_smg(policy, [i["port"] for i in infos], Path(tmp))
            procs.append(smg)
            hits0 = sum(metric(i["metrics_port"], "vllm:prefix_cache_hits_total") for i in infos)
            served0 = [metric(i["metrics_port"], "vllm:request_success_total") for i in infos]
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                results = list(pool.map(lambda m: one_request(base, m, args.max_tokens), requests))
            wall = time.perf_counter() - start
            ttfts = sorted(r[0] for r in results)
            return Result(
                policy=policy, replicas=n, requests=len(results), wall_s=wall,
                output_tok_s=sum(r[1] for r in results) / wall, ttft_p50_s=_pct(ttfts, 50), ttft_p99_s=_pct(ttfts, 99),
                prefix_hit_tokens=sum(metric(i["metrics_port"], "vllm:prefix_cache_hits_total") for i in infos) - hits0,
                requests_per_replica=[metric(i["metrics_port"], "vllm:request_success_total") - s0
                                      for i, s0 in zip(infos, served0)])
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(60)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _pct(sorted_values: list[float], pct: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(pct / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="distinct long system prompts")
    parser.add_argument("--users", type=int, default=16, help="users per system prompt")
    parser.add_argument("--system-words", type=int, default=700, help="words per system prompt (~1.3 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cores-per-replica", type=int, default=1)
    # Explicit, not in --server-args: extra server flags must not silently drop the budget the workload is sized for.
    parser.add_argument("--kv-cache-memory", default="224MiB", help="per replica")
    parser.add_argument("--dtype", default="float32",
                        help="fixed, so the KV budget holds the same tokens on every host (auto is bf16 on some)")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="passed to every `pagedserve serve` (last on the line)")
    args = parser.parse_args()
    args.server_args = ["--kv-cache-memory", args.kv_cache_memory, "--dtype", args.dtype, *args.server_args]
    args.cores = sorted(os.sched_getaffinity(0))
    if len(args.cores) < 2 * args.cores_per_replica:
        parser.error(f"2 replicas x {args.cores_per_replica} cores need {2 * args.cores_per_replica} usable cores; "
                     f"this process may use {len(args.cores)}")
    print(json.dumps({"benchmark": "scale_out_setup", "cpu": cpu_model(), "usable_cores": len(args.cores),
                      "cores_per_replica": args.cores_per_replica, "server_args": args.server_args,
                      "load_avg_before": os.getloadavg()[0]}), flush=True)
    requests = workload(args)
    results = [run_config(policy, n, args, requests) for policy, n in CONFIGS]
    for result in results:
        print(json.dumps({"benchmark": "scale_out", **asdict(result)}), flush=True)
    base = results[-1]
    print(json.dumps({"benchmark": "scale_out_summary", "requests": len(requests),
                      "load_avg_after": os.getloadavg()[0],
                      **{f"{r.policy}_x{r.replicas}_throughput_vs_1": r.output_tok_s / base.output_tok_s
                         for r in results}}))


if __name__ == "__main__":
    main()
