"""A warm benchmark worker in its own process (possibly another venv), driven line by line.

The comparison driver keeps one worker per in-process system alive, so each system
loads and warms up once and the driver can interleave repetitions across systems.
Protocol (JSON lines): worker prints {"ready": ...} once warm; then for each request
line {"workload": <WorkloadConfig fields>, "requests": [<workload_file lines>]}
(the requests themselves travel, so a workload file runs exactly as written) it answers {"timings": [...],
"peak_kv_blocks": ..., "extra": {...}} or {"error": "..."}; an empty line or EOF ends it.
Stdlib only: the vLLM worker runs this under vLLM's own venv.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from dataclasses import asdict
from typing import Callable

from metrics import RequestTiming
from workload import BenchRequest, Workload, WorkloadConfig
from workload_file import request_to_dict

RunFn = Callable[[Workload], tuple[list[RequestTiming], int | None, dict]]


def _protocol_stdout():
    """Keeps the real stdout for protocol lines and points fd 1 at stderr, so library
    logging (and child processes) can never corrupt the protocol."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def serve(setup: Callable[[], RunFn], info: dict | None = None) -> None:
    proto = _protocol_stdout()
    run = setup()
    proto.write(json.dumps({"ready": True, **(info or {})}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            break
        try:
            workload = _decode(json.loads(line))
            timings, peak, extra = run(workload)
            reply = {"timings": [asdict(t) for t in timings], "peak_kv_blocks": peak, "extra": extra}
        except Exception as exc:  # report, keep serving: the driver decides what to do
            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        proto.write(json.dumps(reply) + "\n")


def _encode(workload: Workload) -> str:
    return json.dumps({"workload": asdict(workload.config), "source": workload.source,
                       "requests": [request_to_dict(r) for r in workload.requests]})


def _decode(msg: dict) -> Workload:
    requests = tuple(BenchRequest(r["request_id"], tuple(r["prompt_token_ids"]), r["max_tokens"], r["arrival_s"])
                     for r in msg["requests"])
    return Workload(WorkloadConfig(**msg["workload"]), requests, msg.get("source", "seeded"))


class WorkerClient:
    def __init__(self, argv: list[str], env: dict | None = None, log_path: str | None = None) -> None:
        self.argv = argv
        if log_path:
            os.makedirs(os.path.dirname(log_path), exist_ok=True)
        self._log = open(log_path, "ab") if log_path else None
        # Own process group: close() can then stop the worker's children too (vLLM's engine core process).
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log or None, env=env, text=True, bufsize=1,
                                     start_new_session=True)
        try:  # until ready nobody else holds the worker: any way out (SIGTERM's SystemExit too) stops it
            self.info = self._read()
            if not self.info.get("ready"):
                raise RuntimeError(f"worker {argv} did not start: {self.info}")
        except BaseException:
            self._kill_group()
            raise

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.argv} exited with {self.proc.wait()}")
        return json.loads(line)

    def run(self, workload: Workload) -> tuple[list[RequestTiming], int | None, dict]:
        self.proc.stdin.write(_encode(workload) + "\n")
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"worker {self.argv[-1]}: {reply['error']}\n{reply.get('traceback', '')}")
        timings = [RequestTiming(t["request_id"], t["arrival_s"], tuple(t["token_times_s"]),
                                 tuple(t["output_token_ids"])) for t in reply["timings"]]
        return timings, reply["peak_kv_blocks"], reply["extra"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):  # mid-run or stuck: stop the whole group
                self._kill_group()
        try:  # a child the worker left behind (it shares the group) must not keep a core busy
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._log:
            self._log.close()

    def _kill_group(self) -> None:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue
