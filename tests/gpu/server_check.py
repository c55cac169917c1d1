"""`pagedserve serve` on CUDA: gRPC and OpenAI HTTP answers, 64 concurrent streams, cancellation frees KV blocks.

    python3 tests/gpu/server_check.py --out server.json --pagedserve SITE/bin/pagedserve --workdir DIR [--dry-run]

Starts the installed console script on a tiny random Llama (Triton attention, fp32), then checks (each a dict with
"status"): health SERVING; the same greedy prompt through gRPC and /v1/completions gives the same text; 64 streams at
once (half gRPC, half HTTP server-sent events) all finish, and four of them equal the same prompt served alone; a
cancelled gRPC stream and a dropped HTTP stream leave every KV block free; SIGTERM drains to exit status 0.
--dry-run: CPU under Triton's interpreter, 4 streams of 3 tokens, the same fields.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import json
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

import tiny_models
from service_fixtures import ServerProcess, engine_idle, health, model_info, stub, wait_ready, wait_until

from pagedserve.v1 import generate_pb2 as pb


@dataclass(frozen=True, slots=True)
class Scale:
    device: str
    streams: int
    tokens: int
    kv_memory: str


GPU = Scale("cuda", 64, 32, "64MiB")
DRY = Scale("cpu", 4, 3, "8MiB")
PROMPT_LEN = 20


def prompt(i: int) -> list[int]:
    return torch.randint(3, tiny_models.VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(100 + i)).tolist()


def start(binary: Path, model: Path, scale: Scale, workdir: Path) -> ServerProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    ready, log_path = workdir / "ready.json", workdir / "server.log"
    ready.unlink(missing_ok=True)
    cmd = [str(binary), "serve", "--model", str(model), "--device", scale.device, "--attention-backend", "triton",
           "--dtype", "float32", "--port", "0", "--http-port", "0", "--metrics-port", "0", "--ready-file", str(ready),
           "--max-model-len", "512", "--kv-cache-memory", scale.kv_memory, "--log-level", "INFO"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    info = wait_ready(proc, ready, log_path, timeout=120)
    return ServerProcess(proc, workdir, info["port"], info["metrics_port"], log_path, info.get("http_port"))


def grpc_request(ids: list[int], tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingOptions(temperature=0),
                              stopping=pb.StoppingOptions(max_new_tokens=tokens, ignore_eos=True))


def grpc_generate(channel: grpc.Channel, ids: list[int], tokens: int) -> tuple[list[int], str]:
    frames = list(stub(channel).Generate(grpc_request(ids, tokens), timeout=120))
    return [t for f in frames for t in f.delta.token_ids], "".join(f.delta.text for f in frames)


@contextlib.contextmanager
def http_post(server: ServerProcess, body: dict) -> Iterator[http.client.HTTPResponse]:
    """POST /v1/completions on its own connection, closed afterwards (an open keep-alive one delays the drain)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        yield conn.getresponse()
    finally:
        conn.close()


def completion_body(ids: list[int], tokens: int, stream: bool) -> dict:
    return {"prompt": ids, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


def http_stream(server: ServerProcess, ids: list[int], tokens: int) -> str:
    """Reads server-sent events to [DONE]; returns the concatenated text."""
    with http_post(server, completion_body(ids, tokens, True)) as response:
        assert response.status == 200, response.read()
        text = []
        for raw in response:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                return "".join(text)
            if line.startswith("data: "):
                text.extend(c["text"] for c in json.loads(line[6:])["choices"])
    raise AssertionError("stream ended without [DONE]")


def check_health(server: ServerProcess, channel: grpc.Channel, scale: Scale) -> dict:
    status = health(channel)
    return {"status": "passed" if status == 1 else "failed", "grpc_health": status}


def check_protocols_agree(server: ServerProcess, channel: grpc.Channel, scale: Scale) -> dict:
    ids = prompt(0)
    tokens, grpc_text = grpc_generate(channel, ids, scale.tokens)
    with http_post(server, completion_body(ids, scale.tokens, False)) as response:
        http_text = json.loads(response.read())["choices"][0]["text"]
    ok = len(tokens) == scale.tokens and grpc_text == http_text
    return {"status": "passed" if ok else "failed", "grpc_tokens": tokens, "grpc_text": grpc_text,
            "http_text": http_text}


def check_concurrent_streams(server: ServerProcess, channel: grpc.Channel, scale: Scale) -> dict:
    half = scale.streams // 2
    start_time = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(scale.streams) as pool:
        grpc_jobs = [pool.submit(grpc_generate, channel, prompt(i), scale.tokens) for i in range(half)]
        http_jobs = [pool.submit(http_stream, server, prompt(i), scale.tokens) for i in range(half, scale.streams)]
        grpc_out = [j.result() for j in grpc_jobs]
        http_out = [j.result() for j in http_jobs]
    wall = time.perf_counter() - start_time
    short = [i for i, (t, _) in enumerate(grpc_out) if len(t) != scale.tokens]
    alone = {i: grpc_generate(channel, prompt(i), scale.tokens) for i in (0, 1)}
    alone.update({i: grpc_generate(channel, prompt(i), scale.tokens) for i in (half, half + 1)})
    differ = [i for i in (0, 1) if alone[i] != grpc_out[i]]
    differ += [i for i in (half, half + 1) if alone[i][1] != http_out[i - half]]
    ok = not short and not differ and all(http_out)
    return {"status": "passed" if ok else "failed", "streams": scale.streams, "tokens_each": scale.tokens,
            "wall_s": round(wall, 2), "short_grpc_streams": short, "differ_from_alone": differ}


def check_cancel_frees_blocks(server: ServerProcess, channel: grpc.Channel, scale: Scale) -> dict:
    wait_until(lambda: engine_idle(channel), 60, "an idle engine")
    call = stub(channel).Generate(grpc_request(prompt(1), 400), timeout=300)
    received = 0
    for frame in call:
        received += len(frame.delta.token_ids)
        if received >= 3:
            break
    held = model_info(channel).kv_cache.used_blocks
    call.cancel()
    wait_until(lambda: engine_idle(channel), 60, "the cancelled gRPC request to leave the engine")
    with http_post(server, completion_body(prompt(2), 400, True)) as response:
        response.readline()
        held_http = model_info(channel).kv_cache.used_blocks
    wait_until(lambda: engine_idle(channel), 60, "the dropped HTTP request to leave the engine")
    after = model_info(channel).kv_cache
    ok = held >= 1 and after.used_blocks == 0 and after.free_blocks == after.total_blocks
    return {"status": "passed" if ok else "failed", "blocks_held_before_cancel": held,
            "blocks_held_during_http_stream": held_http, "used_after": after.used_blocks,
            "free_after": after.free_blocks, "total": after.total_blocks}


CHECKS = {"health": check_health, "protocols_agree": check_protocols_agree,
          "concurrent_streams": check_concurrent_streams, "cancel_frees_blocks": check_cancel_frees_blocks}


def run_checks(server: ServerProcess, scale: Scale) -> dict:
    results = {}
    with grpc.insecure_channel(server.target) as channel:
        for name, check in CHECKS.items():
            t0 = time.perf_counter()
            try:
                results[name] = check(server, channel, scale)
            except Exception as exc:  # later checks still run and report
                results[name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()[-2000:]}
            results[name]["duration_s"] = round(time.perf_counter() - t0, 1)
            print(f"{name:20} {results[name]['status']:8} {results[name]['duration_s']} s", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pagedserve", type=Path, required=True, help="the installed console script")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    scale = DRY if args.dry_run else GPU
    # timeout(1) ends a stage with SIGTERM: turn it into an exception so the server is still stopped below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_models.make_tiny(Path(tmp) / "llama", hidden_size=128, intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
        t0 = time.perf_counter()
        server = start(args.pagedserve, model, scale, args.workdir)
        report = {"device": scale.device, "startup_s": round(time.perf_counter() - t0, 1)}
        try:
            report["checks"] = run_checks(server, scale)
        finally:
            report["exit_code_after_sigterm"] = server.stop()
            args.out.write_text(json.dumps(report, indent=1))
    failed = any(c["status"] != "passed" for c in report["checks"].values())
    return 1 if failed or report["exit_code_after_sigterm"] != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
