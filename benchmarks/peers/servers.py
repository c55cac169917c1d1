"""Start, health-check and stop the servers we compare: vLLM's OpenAI server, llama.cpp's
llama-server and pagedserve's server (gRPC, or its OpenAI HTTP API). Each runs in its own process group so that
stopping it also stops its children (vLLM's engine core, workers)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import paths

GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env(kv_gib: int, bind: str, preload: bool = False, tier: str = "native") -> dict:
    """bind: VLLM_CPU_OMP_THREADS_BIND ('auto' = vLLM's choice: on this 2-core machine
    it reserves one core for the frontend and computes on the other). preload: LD_PRELOAD tcmalloc and
    Intel OpenMP, as vLLM's CPU install docs recommend (its worker warns when they are missing). tier avx2: vLLM's
    AVX2 kernel library and torch/oneDNN capped at AVX2 (vllm_avx2/sitecustomize.py), as on an AVX2-only host."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
               VLLM_CPU_OMP_THREADS_BIND=bind, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if preload:
        env["LD_PRELOAD"] = ":".join(str(lib) for lib in vllm_preload_libs())
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; supported: {', '.join(TIERS)}")
    if tier == "avx2":
        site = str(Path(__file__).resolve().parent / "vllm_avx2")
        env.update(TORCH_TIER_ENV[tier],
                   PYTHONPATH=os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p))
    return env


# Debian's libtcmalloc-minimal4 / libgoogle-perftools4 (install_vllm.sh installs the first when missing).
_TCMALLOC_GLOBS = ("libtcmalloc_minimal.so.4*", "libtcmalloc.so.4*")


def vllm_preload_libs() -> list[Path]:
    """[tcmalloc, libiomp5]: tcmalloc from the system, libiomp5 from the intel-openmp wheel in vLLM's venv."""
    lib_dirs = [Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib")]
    tcmalloc = next((m for d in lib_dirs for g in _TCMALLOC_GLOBS for m in sorted(d.glob(g))), None)
    iomp = paths.vllm_python().parent.parent / "lib" / "libiomp5.so"
    if tcmalloc is None:
        raise FileNotFoundError("no libtcmalloc for the vLLM *-preload systems: apt-get install libtcmalloc-minimal4 "
                                "(benchmarks/peers/install_vllm.sh does it when run as root)")
    if not iomp.is_file():
        raise FileNotFoundError(f"no {iomp} for the vLLM *-preload systems: rerun benchmarks/peers/install_vllm.sh "
                                "(it installs the pinned intel-openmp wheel)")
    return [tcmalloc, iomp]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    target: str  # http://host:port or host:port (gRPC)
    log_path: Path
    grpc_target: str | None = None  # pagedserve with --http-port: its gRPC port too (same process, same engine)
    llama: "LlamaBuild | None" = None  # llama-server: the build that ran

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # the group of the process we started
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _spawn(name: str, argv: list[str], env: dict | None, log_dir: Path) -> tuple[subprocess.Popen, Path]:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "ab")
    # cwd outside the repo: `python -m` puts cwd on sys.path, and the repo root there
    # would make engine/, kernels/ importable top-level beside the pagedserve namespace
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=log_dir,
                            start_new_session=True)
    return proc, log_path


def _wait_http(server: Server, path: str, timeout: float) -> None:
    """Until the server answers `path`; any way out but success (timeout, exit, SIGTERM's SystemExit, ^C)
    stops it, since nobody else holds it yet."""
    try:
        _poll_http(server, path, timeout)
    except BaseException:
        server.stop(timeout=10)
        raise


def _poll_http(server: Server, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited ({server.proc.returncode}); see {server.log_path}")
        try:
            with urllib.request.urlopen(server.target + path, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{server.name} not healthy after {timeout:.0f} s; see {server.log_path}")


def start_vllm(model_dir: str, dtype: str, log_dir: Path, kv_gib: int = 2, bind: str = "auto",
               timeout: float = 900, preload: bool = False, extra_args: tuple[str, ...] = ()) -> Server:
    port = free_port()
    argv = [str(paths.vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", "model", "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
            "--max-model-len", "2048", "--no-enable-prefix-caching", "--disable-uvicorn-access-log",
            "--seed", "0", *extra_args]
    tag = "-preload" if preload else ""
    proc, log = _spawn(f"vllm-server{tag}-{dtype}", argv, vllm_env(kv_gib, bind, preload), log_dir)
    server = Server("vllm-server", proc, f"http://127.0.0.1:{port}", log)
    _wait_http(server, "/health", timeout)
    return server


SLOT_ROUNDING = 256  # llama-server's slot context is rounded up to this many tokens


def slot_context(requests) -> int:
    """The context one llama-server slot needs for these requests (BenchRequests): the longest prompt + output,
    rounded up. A slot shorter than a request makes llama-server truncate it (HTTP 200, fewer tokens)."""
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    return -(-(longest + 1) // SLOT_ROUNDING) * SLOT_ROUNDING


def start_llama_server(model_dir: str, dtype: str, log_dir: Path, threads: int = 2, parallel: int = 64,
                       ctx_per_slot: int = 512, timeout: float = 300, gguf: Path | None = None,
                       extra_args: tuple[str, ...] = (), tier: str = "native") -> Server:
    """gguf: serve this file; default: the model folder's f32/bf16 GGUF made by convert_gguf.sh.
    ctx_per_slot: see slot_context; -c is shared by the -np slots. tier: which build (build_llama_server.sh TIER).
    The server's `llama` says which binary ran, its build flags and llama.cpp's own system_info line."""
    if NO_REPACK in extra_args:
        raise ValueError(f"{NO_REPACK} turns off llama.cpp's repacked kernels: the peer would not be at its best. "
                         "On a VM that lists AMX but refuses its tile state, build_llama_server.sh native builds "
                         "without AMX instead")
    gguf = gguf or paths.gguf_dir() / f"{Path(model_dir).name}-{GGUF_TYPES[dtype]}.gguf"
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} missing: run benchmarks/peers/convert_gguf.sh {model_dir}")
    binary = paths.llama_server(tier)
    if not binary.is_file():
        raise FileNotFoundError(f"{binary} missing: run benchmarks/peers/build_llama_server.sh {tier}")
    port = free_port()
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(parallel * ctx_per_slot),
            "--cont-batching", "--no-webui", "-a", "model", *extra_args]
    info = probe_system_info(binary, gguf, threads)  # before the measured server starts: it runs alone
    server = _start_llama(argv, gguf, log_dir, timeout, tier)
    server.llama = LlamaBuild(tier, str(binary), paths.llama_build_info(tier), info, " ".join(argv[1:]))
    return server


def probe_system_info(binary: Path, gguf: Path, threads: int, timeout: float = 60) -> str:
    """llama.cpp's `system_info:` line (its ISA features and REPACK) from a short-lived llama-server at trace
    verbosity: current builds print it only at `-lv 4`, which the measured server must not run with (it logs per
    token). The probe is stopped as soon as the line appears."""
    import threading

    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(free_port()), "-t", str(threads),
            "-np", "1", "-c", "512", "--no-webui", "-lv", "4"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    try:
        for line in proc.stdout:
            if "system_info:" in line:
                return line.split("system_info:", 1)[1].strip()
        return f"not printed (llama-server exited {proc.poll()} or ran past {timeout:.0f} s)"
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()


NO_REPACK = "--no-repack"


@dataclass(frozen=True, slots=True)
class LlamaBuild:
    """Which llama-server ran, recorded with every result: the tier's build (build_llama_server.sh writes its ISA
    flags and AMX probe result to pagedserve-build.json), and the `system_info` line llama.cpp printed (its ISA
    features and REPACK), and the arguments it ran with."""
    tier: str
    binary: str
    build: dict
    system_info: str
    args: str


class LlamaIllegalInstruction(RuntimeError):
    """llama-server was killed by SIGILL (an instruction the CPU or VM does not allow)."""


def _start_llama(argv: list[str], gguf: Path, log_dir: Path, timeout: float, tier: str) -> Server:
    proc, log = _spawn(f"llama-server-{tier}-{gguf.stem}", argv, None, log_dir)
    server = Server("llama-server", proc, f"http://127.0.0.1:{port_of(argv)}", log)
    try:
        _wait_http(server, "/health", timeout)
    except RuntimeError:
        if proc.returncode == -signal.SIGSEGV and paths.llama_build_info(tier).get("amx") == "usable":
            raise RuntimeError(f"llama-server ({tier}) crashed (SIGSEGV), built with AMX; see {log}. "
                               "Rebuild without AMX: rm -r the build folder, then PAGEDSERVE_LLAMA_AMX=off "
                               f"build_llama_server.sh {tier}") from None
        if proc.returncode != -signal.SIGILL:
            raise
        raise LlamaIllegalInstruction(
            f"llama-server ({tier}) died of SIGILL; see {log}. A build made on another host, or a VM that lists "
            f"AMX but faults on it where the probe passed: rebuild with build_llama_server.sh {tier}") from None
    return server


def port_of(argv: list[str]) -> str:
    return argv[argv.index("--port") + 1]


def _wait_ready(proc: subprocess.Popen, ready: Path, log: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not ready.is_file():
        if proc.poll() is not None:
            raise RuntimeError(f"pagedserve server exited ({proc.returncode}); see {log}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"pagedserve server not ready after {timeout:.0f} s; see {log}")
        time.sleep(0.5)
    time.sleep(0.2)  # the file may be mid-write on the first poll
    return json.loads(ready.read_text())


ISA_ENV = "PAGEDSERVE_CPU_ISA"  # pagedserve's kernels: build and load this tier instead of the host's best
TIERS = ("native", "avx2")  # the tiers the harness compares: llama.cpp builds and pagedserve kernel tiers alike


# torch's own kernels and oneDNN's (prefill GEMMs, SDPA) follow these, so a forced tier caps them as well: an
# AVX2-only host's prefill runs AVX2 GEMMs, and an AVX-512 host forced to avx2 must not flatter it.
TORCH_TIER_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def pagedserve_env(tier: str) -> dict[str, str]:
    """The environment of a pagedserve process at `tier`: native drops any ISA_ENV (and torch cap) the caller's shell
    holds (the host's best tier, as shipped); another tier forces it, torch's and oneDNN's kernels included."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; supported: {', '.join(TIERS)}")
    capped = {ISA_ENV, *(k for caps in TORCH_TIER_ENV.values() for k in caps)}
    env = {k: v for k, v in os.environ.items() if k not in capped}
    return env if tier == "native" else {**env, ISA_ENV: tier, **TORCH_TIER_ENV.get(tier, {})}


def start_pagedserve(model_dir: str, dtype: str, log_dir: Path, threads: int = 2,
                     timeout: float = 300, http: bool = False, extra_args: tuple[str, ...] = (),
                     tier: str = "native") -> Server:
    """http: also serve the OpenAI HTTP API and return its http:// target instead of the gRPC one. With as many
    threads as this process may use, the server picks its own (the same number), so it runs as shipped: its thread
    governor is on only when no --num-threads is given."""
    name = f"pagedserve-{'http' if http else 'grpc'}-{dtype}"
    thread_flags = () if threads == len(os.sched_getaffinity(0)) else ("--num-threads", str(threads))
    ready = log_dir / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pagedserve.service", "serve", "--model", model_dir, "--dtype", dtype,
            "--port", "0", "--host", "127.0.0.1", *thread_flags,
            "--no-enable-prefix-caching", "--ready-file", str(ready), "--log-level", "WARNING",
            *(("--http-port", "0", "--served-model-name", "model") if http else ()), *extra_args]
    proc, log = _spawn(name, argv, pagedserve_env(tier), log_dir)
    try:
        ports = _wait_ready(proc, ready, log, timeout)
    except BaseException:  # also SIGTERM's SystemExit: nobody else holds this server yet
        Server(name, proc, "", log).stop(timeout=10)
        raise
    if http:
        return Server("pagedserve-http", proc, f"http://127.0.0.1:{ports['http_port']}", log,
                      f"127.0.0.1:{ports['port']}")
    return Server("pagedserve-grpc", proc, f"127.0.0.1:{ports['port']}", log)
