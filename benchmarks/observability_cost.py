"""What tracing and request logging cost: the same closed-loop gRPC load against servers that differ only in their
observability flags, in one run, alternating rounds (A/B) so a drift of the host hits every arm alike.

Arms (each its own `pagedserve serve` process, all loaded before the first round, only one under load at a time):
  off: the defaults (no tracing, no request log, the 10 s stats line)
  on:  --enable-log-requests and --otlp-traces-endpoint to an OTLP receiver in this process (the official
       TraceService from opentelemetry-proto on loopback), every request sent with a traceparent
  log, trace (--arms): each half of `on` alone, to tell their costs apart
  base (--baseline-python PY): the defaults under another interpreter / install, e.g. a venv holding main's code,
       for "no cost when off" against the code before this feature

Each round sends `--requests-per-round` requests (`--concurrency` streams, `--max-tokens` greedy tokens, short
prompts: per-request costs weigh most) to each arm in turn (`--mode concurrent`: to every arm at once, so a busy
host's noise hits them alike). Besides throughput, each round records the server's own CPU time per request (from
/proc: user + system of the whole process), which a busy host disturbs far less than wall-clock throughput. Prints
one JSON line per arm and round, then a summary with each arm relative to `off` (median of per-round ratios).
Throughput is meaningful only on a quiet host; label results taken on a busy one "noisy".

    python benchmarks/observability_cost.py --rounds 5 --requests-per-round 200        # 1000 requests per arm
    python benchmarks/observability_cost.py --rounds 1 --requests-per-round 8          # smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generation_service_pb2_grpc

PROMPTS = ("The capital of France is", "Tell me about the sea.", "Count: one, two,", "A haiku about rain:")
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile")


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Counts the spans it receives (a real OTLP endpoint: the exporter's batches cost what they would)."""

    def __init__(self) -> None:
        self.spans, self._lock = 0, threading.Lock()

    def Export(self, request, context):  # noqa: N802, ANN001, ANN201 - the generated servicer's signature
        n = sum(len(s.spans) for rs in request.resource_spans for s in rs.scope_spans)
        with self._lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


@dataclass
class Arm:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    traced: bool


def host() -> dict:
    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return {"cpu": model, "isa_flags": [f for f in ISA_FLAGS if f in flags], "cores": len(os.sched_getaffinity(0)),
            "load_avg": os.getloadavg()}


def start_arm(name: str, python: str, args: list[str], workdir: Path, traced: bool) -> Arm:
    workdir.mkdir(parents=True, exist_ok=True)
    ready, log_path = workdir / "ready.json", workdir / "server.log"
    cmd = [python, "-m", "pagedserve.service", "serve", "--port", "0", "--ready-file", str(ready), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")})
    deadline = time.monotonic() + 600
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{name}: server did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    return Arm(name, proc, json.loads(ready.read_text())["port"], log_path, traced)


def one_request(stub, i: int, max_tokens: int, traced: bool) -> int:  # noqa: ANN001
    request = pb.GenerateRequest(text=PROMPTS[i % len(PROMPTS)], sampling=pb.SamplingOptions(temperature=0),
                                 stopping=pb.StoppingOptions(max_new_tokens=max_tokens, ignore_eos=True))
    metadata = (("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"),) if traced else ()
    frames = list(stub.Generate(request, metadata=metadata, timeout=600))
    return frames[-1].final.usage.completion_tokens


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def run_round(arm: Arm, requests: int, concurrency: int, max_tokens: int) -> dict:
    with grpc.insecure_channel(f"127.0.0.1:{arm.port}") as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        one_request(stub, 0, 2, arm.traced)  # a warm connection; not timed
        start, cpu_start = time.perf_counter(), cpu_seconds(arm.proc.pid)
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(pool.map(lambda i: one_request(stub, i, max_tokens, arm.traced), range(requests)))
        elapsed, cpu = time.perf_counter() - start, cpu_seconds(arm.proc.pid) - cpu_start
    return {"arm": arm.name, "requests": requests, "tokens": tokens, "seconds": round(elapsed, 3),
            "requests_per_s": round(requests / elapsed, 3), "tokens_per_s": round(tokens / elapsed, 2),
            "server_cpu_ms_per_request": round(cpu * 1000 / requests, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests-per-round", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--mode", choices=["alternate", "concurrent"], default="alternate")
    parser.add_argument("--arms", default="off,on", help="comma-separated: off (required), on, log, trace")
    parser.add_argument("--baseline-python", help="interpreter of a second install (e.g. main's) for a `base` arm")
    parser.add_argument("--server-args", default="--max-model-len 512 --kv-cache-memory 64MiB --max-num-seqs 8",
                        help="flags every arm gets")
    parser.add_argument("--label", default="", help="e.g. noisy / quiet, copied into every line")
    parser.add_argument("--output", type=Path, help="also append the JSON lines here")
    args = parser.parse_args()

    receiver = Receiver()
    otlp = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, otlp)
    otlp_port = otlp.add_insecure_port("127.0.0.1:0")
    otlp.start()
    common = args.server_args.split()
    tracing, logging_ = ["--otlp-traces-endpoint", f"127.0.0.1:{otlp_port}"], ["--enable-log-requests"]
    known = {"off": (common, False), "on": ([*common, *logging_, *tracing], True), "log": ([*common, *logging_], True),
             "trace": ([*common, *tracing], True)}
    specs = [(name, sys.executable, *known[name]) for name in args.arms.split(",")]
    if args.baseline_python:
        specs.insert(0, ("base", args.baseline_python, common, False))
    out = open(args.output, "a") if args.output else None  # noqa: SIM115 - closed below

    def emit(record: dict) -> None:
        line = json.dumps({"benchmark": "observability_cost", "label": args.label, **record})
        print(line, flush=True)
        if out:
            out.write(line + "\n")

    with tempfile.TemporaryDirectory(prefix="obs-cost-") as tmp:
        arms = [start_arm(name, py, a, Path(tmp) / name, traced) for name, py, a, traced in specs]
        try:
            emit({"setup": host(), "args": vars(args) | {"output": str(args.output)}, "arms": [a.name for a in arms]})
            results: dict[str, list[dict]] = {a.name: [] for a in arms}
            for r in range(args.rounds):
                if args.mode == "concurrent":
                    with concurrent.futures.ThreadPoolExecutor(len(arms)) as pool:
                        done = list(pool.map(lambda a: run_round(a, args.requests_per_round, args.concurrency,
                                                                 args.max_tokens), arms))
                else:
                    done = [run_round(arm, args.requests_per_round, args.concurrency, args.max_tokens)
                            for arm in (arms if r % 2 == 0 else arms[::-1])]  # alternate the order too
                for result in done:
                    results[result["arm"]].append(result)
                    emit({"round": r, "mode": args.mode, **result})
            emit(summary(results, receiver.spans, arms))
        finally:
            for arm in arms:
                arm.proc.terminate()
            for arm in arms:
                arm.proc.wait(60)
            otlp.stop(None)
            if out:
                out.close()


def summary(results: dict[str, list[dict]], spans: int, arms: list[Arm]) -> dict:
    off = results["off"]
    record: dict = {"summary": True, "spans_received": spans}
    for name, rounds in results.items():
        ratios = [r["tokens_per_s"] / o["tokens_per_s"] for r, o in zip(rounds, off)]
        cpu = [r["server_cpu_ms_per_request"] / o["server_cpu_ms_per_request"] for r, o in zip(rounds, off)]
        record[name] = {"requests": sum(r["requests"] for r in rounds),
                        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rounds),
                        "vs_off_median": round(statistics.median(ratios), 4),
                        "vs_off_min": round(min(ratios), 4), "vs_off_max": round(max(ratios), 4),
                        "server_cpu_ms_per_request_median": statistics.median(
                            r["server_cpu_ms_per_request"] for r in rounds),
                        "cpu_vs_off_median": round(statistics.median(cpu), 4)}
    for arm in arms:
        lines = arm.log_path.read_text().splitlines()
        record[arm.name]["request_lines"] = sum(1 for line in lines if line.startswith('{"ts"') and "request_" in line)
    return record


if __name__ == "__main__":
    main()
