"""Soak: mixed traffic against one real server for a long time; does anything drift?

Clients (threads) loop over a fixed mix: greedy and sampled streams, streams cancelled after a few tokens,
streams with a deadline shorter than their generation, and bad requests (out-of-range parameters, bad request
ids, garbage bytes). Every SAMPLE_S the server's RSS (from /proc), used KV blocks and running/waiting counts (from
ModelInfo) are recorded beside per-window latency percentiles and error counts. Only the injected failures may
fail: anything else counts as an unexpected error.

    python3 benchmarks/soak.py --minutes 30    # writes benchmarks/results/<date>-soak.json (+ .png); --out names them

The verdict fields compare the first and last fifth of the run after a warm-up: RSS growth in MiB and the
used-block drift at idle points. The plot needs matplotlib (not a project dependency; see peers/plot.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generation_service_pb2_grpc, model_info_pb2

RESULTS = Path(__file__).resolve().parent / "results"  # dated raw results (docs/soak.md reads the latest)
PROMPTS = ["Write a haiku about the sea.", "List three prime numbers:", "Explain gravity to a child.",
           "The capital of France is", "Once upon a time"]
EXPECTED = {"cancelled": grpc.StatusCode.CANCELLED, "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
            "bad_params": grpc.StatusCode.INVALID_ARGUMENT, "bad_id": grpc.StatusCode.INVALID_ARGUMENT,
            "garbage": grpc.StatusCode.INVALID_ARGUMENT}


def start_server(workdir: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / "ready.json"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pagedserve.service", "serve", "--port", "0", "--host", "127.0.0.1",
            "--ready-file", str(ready), "--log-level", "WARNING", *extra]
    proc = subprocess.Popen(argv, cwd=workdir, stdout=open(workdir / "server.log", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while not ready.is_file() or not ready.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start; see {workdir / 'server.log'}")
        time.sleep(0.5)
    return proc, f"127.0.0.1:{json.loads(ready.read_text())['port']}"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Traffic:
    """One client thread's loop; results go into the shared, locked tallies."""

    def __init__(self, target: str, stop: threading.Event, seed: int, tallies: dict, lock: threading.Lock):
        self.channel = grpc.insecure_channel(target)
        self.stub = generation_service_pb2_grpc.GenerationServiceStub(self.channel)
        self.stop, self.rng, self.tallies, self.lock = stop, random.Random(seed), tallies, lock

    def run(self) -> None:
        kinds = ["greedy"] * 4 + ["sampled"] * 3 + ["cancelled", "deadline", "bad_params", "bad_id", "garbage"]
        while not self.stop.is_set():
            kind = self.rng.choice(kinds)
            start = time.monotonic()
            code = self._one(kind)
            self._tally(kind, code, time.monotonic() - start)
        self.channel.close()

    def _one(self, kind: str) -> grpc.StatusCode:
        prompt = self.rng.choice(PROMPTS)
        stopping = pb.StoppingOptions(max_new_tokens=self.rng.randint(8, 48))
        sampling = pb.SamplingOptions(temperature=0 if kind != "sampled" else 0.8, seed=self.rng.randint(0, 99))
        try:
            if kind == "garbage":
                call = self.channel.unary_stream("/pagedserve.v1.GenerationService/Generate")
                list(call(bytes(self.rng.randrange(256) for _ in range(64)), timeout=60))
                return grpc.StatusCode.OK
            if kind == "bad_params":
                sampling = pb.SamplingOptions(temperature=0.5, logit_bias={7: 3e38})
            request = pb.GenerateRequest(text=prompt, sampling=sampling, stopping=stopping,
                                         request_id="bad id\n" if kind == "bad_id" else "")
            if kind == "cancelled":
                call = self.stub.Generate(request, timeout=120)
                next(iter(call))
                call.cancel()
                return grpc.StatusCode.CANCELLED
            timeout = 0.3 if kind == "deadline" else 300
            for _ in self.stub.Generate(request, timeout=timeout):
                pass
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()

    def _tally(self, kind: str, code: grpc.StatusCode, seconds: float) -> None:
        expected = EXPECTED.get(kind, grpc.StatusCode.OK)
        # A deadline request may finish first on a fast machine, and a garbage payload may parse: both fine.
        ok = code == expected or (kind in ("deadline", "garbage") and code == grpc.StatusCode.OK)
        with self.lock:
            self.tallies["requests"] += 1
            self.tallies["unexpected"] += 0 if ok else 1
            if not ok:
                self.tallies["unexpected_examples"].append(f"{kind}: {code.name}")
            if kind in ("greedy", "sampled") and code == grpc.StatusCode.OK:
                self.tallies["latencies"].append(seconds)


def sample(stub, pid: int, started: float, tallies: dict, lock: threading.Lock) -> dict:
    info = stub.ModelInfo(model_info_pb2.ModelInfoRequest(), timeout=30)
    with lock:
        latencies, tallies["latencies"] = tallies["latencies"], []
        requests, unexpected = tallies["requests"], tallies["unexpected"]
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [float("nan")] * 99
    return {"t_s": round(time.monotonic() - started, 1), "rss_mib": round(rss_mib(pid), 1),
            "used_blocks": info.kv_cache.used_blocks, "running": info.scheduler.running_requests,
            "waiting": info.scheduler.waiting_requests, "requests": requests, "unexpected": unexpected,
            "latency_p50_s": round(q[49], 3), "latency_p99_s": round(q[98], 3)}


def verdict(samples: list[dict], warmup_s: float) -> dict:
    steady = [s for s in samples if s["t_s"] >= warmup_s] or samples
    fifth = max(1, len(steady) // 5)
    first, last = steady[:fifth], steady[-fifth:]
    return {"rss_growth_mib": round(statistics.mean(s["rss_mib"] for s in last)
                                    - statistics.mean(s["rss_mib"] for s in first), 1),
            "rss_min_max_mib": [min(s["rss_mib"] for s in steady), max(s["rss_mib"] for s in steady)]}


def plot(result: dict, png: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    t = [s["t_s"] / 60 for s in result["samples"]]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    axes[0].plot(t, [s["rss_mib"] for s in result["samples"]])
    axes[0].set_ylabel("server RSS (MiB)")
    axes[1].plot(t, [s["used_blocks"] for s in result["samples"]])
    axes[1].set_ylabel("used KV blocks")
    axes[2].plot(t, [s["latency_p50_s"] for s in result["samples"]], label="p50")
    axes[2].plot(t, [s["latency_p99_s"] for s in result["samples"]], label="p99")
    axes[2].set_ylabel("stream latency (s)")
    axes[2].set_xlabel("minutes")
    axes[2].legend()
    fig.suptitle(f"soak: {result['minutes']} min, {result['final']['requests']} requests, "
                 f"{result['final']['unexpected']} unexpected errors")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=None,
                        help="writes OUT.json and OUT.png (default: benchmarks/results/<UTC date>-soak)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/pagedserve-soak"))
    args, server_args = parser.parse_known_args()
    proc, target = start_server(args.workdir, server_args)
    stop, lock = threading.Event(), threading.Lock()
    tallies = {"requests": 0, "unexpected": 0, "unexpected_examples": [], "latencies": []}
    threads = [threading.Thread(target=Traffic(target, stop, seed, tallies, lock).run, daemon=True)
               for seed in range(args.clients)]
    channel = grpc.insecure_channel(target)
    stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
    started, samples = time.monotonic(), []
    try:
        for thread in threads:
            thread.start()
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(args.sample_s)
            samples.append(sample(stub, proc.pid, started, tallies, lock))
            print(json.dumps(samples[-1]), flush=True)
        stop.set()
        for thread in threads:
            thread.join(300)
        time.sleep(2)
        idle = sample(stub, proc.pid, started, tallies, lock)
    finally:
        stop.set()
        proc.terminate()
        proc.wait(60)
    result = {"minutes": args.minutes, "clients": args.clients, "cpu": _cpu_model(),
              "samples": samples, "final": idle, "unexpected_examples": tallies["unexpected_examples"][:20],
              "idle_used_blocks_after_run": idle["used_blocks"], **verdict(samples, args.warmup_s)}
    out = args.out or RESULTS / f"{time.strftime('%Y-%m-%d', time.gmtime())}-soak"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
