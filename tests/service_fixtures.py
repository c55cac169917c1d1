"""Real server processes for the service and client tests: `pagedserve serve` on a free localhost port.

Test modules import the fixtures they use from here. The shared server is a process-wide singleton, so it is
started once per test session however many modules import `shared_server`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import generate_pb2, generation_service_pb2_grpc, model_info_pb2

T = TypeVar("T")

START_TIMEOUT_S = 600  # model load on a busy 2-core CI box
# Small and fast: a 512-token context keeps "too long" prompts cheap; 32 MiB of fp32 KV holds 45 blocks.
# fp32: the servers' greedy tokens are compared with transformers' fp32 model and the fp32 offline engine, and
# dtype=auto would compute in bf16 on CPUs with native bf16 (a test may still pass its own --dtype).
BASE_ARGS = ("--max-model-len", "512", "--kv-cache-memory", "32MiB", "--dtype", "float32", "--log-level", "INFO")
GENERATE_METHOD = "/pagedserve.v1.GenerationService/Generate"


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    workdir: Path
    port: int
    metrics_port: int | None
    log_path: Path
    http_port: int | None = None  # the OpenAI HTTP API, when started with --http-port
    host: str = "localhost"
    _stopped: bool = field(default=False, repr=False)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not exit within {timeout}s; log:\n{self.log()[-4000:]}") from None

    def stop(self) -> int | None:
        if self._stopped:
            return self.proc.returncode
        self._stopped = True
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(workdir: Path, *args: str, port: int = 0,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path, Path]:
    """Starts `python -m pagedserve.service serve`; returns (process, ready file, log file) without waiting.
    env: variables added to this process's environment."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready, log_path = workdir / "ready.json", workdir / "server.log"
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pagedserve.service", "serve", "--port", str(port), "--ready-file", str(ready),
           "--metrics-port", "0", *BASE_ARGS, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        # cwd is the temp dir so the repository root never lands on the server's sys.path.
        proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, ready, log_path


def wait_ready(proc: subprocess.Popen, ready: Path, log_path: Path, timeout: float = START_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready.exists():
            return json.loads(ready.read_text())
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}; log:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"server not ready after {timeout}s; log:\n{log_path.read_text()[-4000:]}")


def start_server(workdir: Path, *args: str, port: int = 0, env: dict[str, str] | None = None) -> ServerProcess:
    proc, ready, log_path = spawn_server(workdir, *args, port=port, env=env)
    info = wait_ready(proc, ready, log_path)
    return ServerProcess(proc, workdir, info["port"], info["metrics_port"], log_path, info.get("http_port"))


_SHARED: dict[str, ServerProcess] = {}


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One default-config server for every test that does not need its own settings (gRPC and OpenAI HTTP)."""
    if "default" not in _SHARED:
        _SHARED["default"] = start_server(tmp_path_factory.mktemp("shared-server"), "--max-message-bytes", "1MiB",
                                          "--http-port", "0")
    yield _SHARED["default"]
    _SHARED["default"].stop()


@pytest.fixture(scope="session")
def pooling_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One embedding server (`--runner pooling`, gRPC and HTTP) for the suites that only call it: the embedding
    service's tests and the pooling fuzz suite. 64-token steps, so longer inputs prefill in chunks. A process-wide
    singleton as `shared_server` is: each module importing the fixture holds its own session-scoped copy of it, and
    those copies must not each start a server (both suites on one worker started two)."""
    if "pooling" not in _SHARED:
        _SHARED["pooling"] = start_server(tmp_path_factory.mktemp("pooling-server"), "--runner", "pooling",
                                          "--http-port", "0", "--max-num-batched-tokens", "64")
    yield _SHARED["pooling"]
    _SHARED["pooling"].stop()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Starts servers with extra flags for one test; all are stopped afterwards."""
    started: list[ServerProcess] = []

    def make(*args: str, name: str = "server") -> ServerProcess:
        server = start_server(tmp_path / f"{name}-{len(started)}", *args)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


# --- small gRPC helpers -------------------------------------------------------------------------------------


def stub(channel: grpc.Channel) -> generation_service_pb2_grpc.GenerationServiceStub:
    return generation_service_pb2_grpc.GenerationServiceStub(channel)


def model_info(channel: grpc.Channel) -> model_info_pb2.ModelInfoResponse:
    return stub(channel).ModelInfo(model_info_pb2.ModelInfoRequest(), timeout=30)


def health(channel: grpc.Channel, service: str = "") -> int:
    check = health_pb2_grpc.HealthStub(channel).Check
    return check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def generate_raw(channel: grpc.Channel, payload: bytes, timeout: float = 60) -> list[generate_pb2.GenerateResponse]:
    """Sends undecoded request bytes, for inputs the generated classes refuse to build (bad UTF-8, huge)."""
    call = channel.unary_stream(GENERATE_METHOD, request_serializer=None,
                                response_deserializer=generate_pb2.GenerateResponse.FromString)
    return list(call(payload, timeout=timeout))


def off_main_thread(fn: Callable[..., T], *args: object) -> T:
    """Runs fn in a worker thread. On a CPU-contended box, torch ops issued from the main thread (OpenMP's
    spinning master team) ran 10-30x slower than the same ops from a fresh thread; the server's engine loop
    already runs off the main thread."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls until `predicate()` holds; the timeout only bounds a hang, it is not the property under test."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def engine_idle(channel: grpc.Channel) -> bool:
    """No request running or waiting, and no KV block held by one."""
    info = model_info(channel)
    return (info.scheduler.running_requests == 0 and info.scheduler.waiting_requests == 0
            and info.kv_cache.used_blocks == 0)


def settled_metric_value(server: ServerProcess, name: str, want: float, timeout: float = 5.0) -> float:
    """metric_value once it reaches `want` or `timeout` passes: a request is counted when its handler returns, which
    can be just after the client has read the whole response (a stream's last chunk), so a scrape right after the
    call may still see the old count."""
    deadline = time.monotonic() + timeout
    while True:
        value = metric_value(server, name)
        if value >= want or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def metric_value(server: ServerProcess, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets) scraped from the server's metrics port."""
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))
