"""Every compared system behind one interface: start warm, run a workload, close.

In-process systems live in warm worker processes (worker_protocol); servers are driven
over their own wire protocol (our gRPC, their OpenAI HTTP). `SYSTEMS` names them all.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from metrics import RequestTiming
from workload import Workload, WorkloadConfig, build_workload

import paths
import servers
from grpc_client import run_grpc
from http_client import Endpoint, run_http

BENCH_DIR = Path(__file__).resolve().parent.parent
# Warm-up for servers (workers warm themselves up): compiles/caches every path once.
WARMUP = WorkloadConfig(num_requests=4, prompt_len_min=16, prompt_len_max=48, output_len_min=4,
                        output_len_max=8, seed=99)


@dataclass(frozen=True, slots=True)
class DriverSpec:
    model_dir: str
    dtype: str
    threads: int
    log_dir: Path
    vllm_bind: str = "auto"
    vllm_kv_gib: int = 2
    slot_tokens: int = 512  # llama-server's context per slot (servers.slot_context of the workload)
    parallel: int = 64  # llama-server's slots: the most concurrent requests
    gguf: str | None = None  # a GGUF file pagedserve and llama-server serve instead of model_dir's (low concurrency)
    tier: str = "native"  # servers.TIERS: llama-server's build and pagedserve's kernel tier
    pagedserve_dtype: str | None = None  # pagedserve's --dtype where it differs from the peers' (auto); None: dtype

    @property
    def our_dtype(self) -> str:
        return self.pagedserve_dtype or self.dtype

    def __post_init__(self) -> None:
        if self.tier not in servers.TIERS:
            raise ValueError(f"unknown tier {self.tier!r}; supported: {', '.join(servers.TIERS)}")


class Driver(Protocol):
    name: str
    mode: str  # "in-process" or "wire"

    def run(self, workload: Workload) -> tuple[list[RequestTiming], int | None, dict]: ...

    def close(self) -> None: ...


class WorkerDriver:
    mode = "in-process"

    def __init__(self, name: str, argv: list[str], env: dict | None, log: Path) -> None:
        from worker_protocol import WorkerClient

        self.name = name
        self.client = WorkerClient(argv, env=env, log_path=str(log))

    def run(self, workload):
        return self.client.run(workload)

    def close(self) -> None:
        self.client.close()


class ServerDriver:
    mode = "wire"

    def __init__(self, name: str, server: servers.Server, send: Callable) -> None:
        self.name, self.server, self._send = name, server, send
        try:
            self._send(build_workload(WARMUP))
        except BaseException:  # nobody else holds the server yet: stop it, or it outlives the run
            server.stop()
            raise

    def run(self, workload):
        return self._send(workload), None, {}

    def close(self) -> None:
        self.server.stop()


def _our_worker(system: str, own_threads: bool = False) -> Callable[[DriverSpec], Driver]:
    """own_threads: with as many threads as this process may use, let the engine pick its own (`--threads 0`), so
    it runs as the server does, thread governor included (under --contention a fixed spinning pool collapses)."""
    def make(spec: DriverSpec) -> Driver:
        threads = 0 if own_threads and spec.threads == len(os.sched_getaffinity(0)) else spec.threads
        argv = [sys.executable, str(BENCH_DIR / "worker.py"), system, "--model", spec.gguf or spec.model_dir,
                "--dtype", spec.our_dtype if system == "pagedserve" else spec.dtype, "--threads", str(threads)]
        env = servers.pagedserve_env(spec.tier) if system == "pagedserve" else None
        return WorkerDriver(system, argv, env, spec.log_dir / f"{system}-{spec.dtype}.log")
    return make


def _vllm_offline(name: str, all_cores: bool, preload: bool) -> Callable[[DriverSpec], Driver]:
    """all_cores: OpenMP bound to as many cores as the others get (vLLM's default `auto` keeps one core
    of this 2-core machine for the frontend; a fair table shows both). preload: tcmalloc + Intel OpenMP
    in LD_PRELOAD, the setup vLLM's CPU docs recommend."""
    def make(spec: DriverSpec) -> Driver:
        argv = [str(paths.vllm_python()), str(BENCH_DIR / "peers" / "vllm_worker.py"), "--model", spec.model_dir,
                "--dtype", spec.dtype]
        bind = f"0-{spec.threads - 1}" if all_cores else spec.vllm_bind
        env = servers.vllm_env(spec.vllm_kv_gib, bind, preload, spec.tier)
        return WorkerDriver(name, argv, env, spec.log_dir / f"{name}-offline-{spec.dtype}.log")
    return make


def _vllm_http(name: str, preload: bool) -> Callable[[DriverSpec], Driver]:
    def make(spec: DriverSpec) -> Driver:
        server = servers.start_vllm(spec.model_dir, spec.dtype, spec.log_dir, spec.vllm_kv_gib, spec.vllm_bind,
                                    preload=preload)
        endpoint = Endpoint(server.target + "/v1/completions", "model", (("return_token_ids", True),))
        return ServerDriver(name, server, lambda w: run_http(endpoint, w))
    return make


def _llama_server(spec: DriverSpec) -> Driver:
    server = servers.start_llama_server(spec.model_dir, spec.dtype, spec.log_dir, spec.threads, spec.parallel,
                                        spec.slot_tokens, gguf=Path(spec.gguf) if spec.gguf else None,
                                        tier=spec.tier)
    # cache_prompt off: repeats replay the same prompts (the other systems run without prefix caching too)
    endpoint = Endpoint(server.target + "/completion", "model", (("cache_prompt", False),), style="llama")
    return ServerDriver("llama-server", server, lambda w: run_http(endpoint, w))


def _pagedserve_grpc(spec: DriverSpec) -> Driver:
    server = servers.start_pagedserve(spec.gguf or spec.model_dir, spec.our_dtype, spec.log_dir, spec.threads,
                                      tier=spec.tier)
    return ServerDriver("pagedserve-grpc", server, lambda w: run_grpc(server.target, w))


def _pagedserve_http(spec: DriverSpec) -> Driver:
    """Our OpenAI HTTP API driven by the very client and request body vLLM's server gets."""
    server = servers.start_pagedserve(spec.gguf or spec.model_dir, spec.our_dtype, spec.log_dir, spec.threads,
                                      http=True, tier=spec.tier)
    endpoint = Endpoint(server.target + "/v1/completions", "model", (("return_token_ids", True),))
    return ServerDriver("pagedserve-http", server, lambda w: run_http(endpoint, w))


SYSTEMS: dict[str, tuple[str, Callable[[DriverSpec], Driver]]] = {
    "pagedserve": ("in-process", _our_worker("pagedserve", own_threads=True)),
    "vllm": ("in-process", _vllm_offline("vllm", all_cores=False, preload=False)),
    "vllm-allcores": ("in-process", _vllm_offline("vllm-allcores", all_cores=True, preload=False)),
    "vllm-preload": ("in-process", _vllm_offline("vllm-preload", all_cores=False, preload=True)),
    "vllm-allcores-preload": ("in-process", _vllm_offline("vllm-allcores-preload", all_cores=True, preload=True)),
    "hf_cb": ("in-process", _our_worker("hf_cb")),
    "hf_static": ("in-process", _our_worker("hf_static")),
    "pagedserve-grpc": ("wire", _pagedserve_grpc),
    "pagedserve-http": ("wire", _pagedserve_http),
    "vllm-http": ("wire", _vllm_http("vllm-http", preload=False)),
    "vllm-http-preload": ("wire", _vllm_http("vllm-http-preload", preload=True)),
    "llama-server": ("wire", _llama_server),
}


def start(name: str, spec: DriverSpec) -> Driver:
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; supported: {', '.join(SYSTEMS)}")
    return SYSTEMS[name][1](spec)
