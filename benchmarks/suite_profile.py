"""Where the test suite's CPU time goes: every Python process of one run (the pytest workers, the servers the tests
start, the device check's stages, helper scripts) sampled by py-spy, then summed by process kind, by test file and by
function. The CI budget (30 minutes on 2 cores) is spent across hundreds of processes, and pytest's --durations sees
only wall time per test: a test that waits on a busy server shows the server's work as its own, and a fixture's cost
lands on whichever test used it first.

    pip install py-spy==0.4.3   # a sampling profiler; not a dependency of the project
    python benchmarks/suite_profile.py record OUT.txt [pytest arguments]   # default: the whole suite, 2 workers
    python benchmarks/suite_profile.py report OUT.txt [--top 40]          # JSON on stdout

`record` runs pytest as tests/run.sh does (in the current venv) under `py-spy record --subprocesses`, at 20 samples
a second (a few percent of overhead). It cannot wrap tests/run.sh itself: py-spy samples nothing under a shell that
later execs into pytest (tried: an empty profile). Idle threads are not sampled, so a second of samples is a second of CPU.
`report` needs nothing but the file.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATE = 20
_PROCESS = re.compile(r'process \d+:"(.*?)"(?:;|$)', re.S)
_TEST_FILE = re.compile(r"\((?:[^ ()]*/)?(test_\w+\.py):\d+\)")
_COUNT = re.compile(r"\s(\d+)\s*$")


@dataclass(frozen=True, slots=True)
class Sample:
    """One folded stack of py-spy's raw output: the chain of processes (outermost first) and the frames of the
    innermost one, each `function (file:line)`, outermost first."""

    processes: tuple[str, ...]
    frames: tuple[str, ...]
    count: int


def parse(text: str) -> list[Sample]:
    """py-spy's raw (folded) format. A process frame quotes its command line, which may hold ';' and newlines (a
    `python -c` script), so samples are cut where a line starts with `process `, not at every newline."""
    samples = []
    for chunk in re.split(r"(?m)^(?=process \d+:)", text):
        count = _COUNT.search(chunk)
        if not chunk.startswith("process ") or count is None:
            continue
        body = chunk[:count.start()]
        processes, at = [], 0
        while (match := _PROCESS.match(body, at)) is not None:
            processes.append(" ".join(match.group(1).split()))
            at = match.end()
        frames = tuple(f for f in body[at:].split(";") if f)
        samples.append(Sample(tuple(processes), frames, int(count.group(1))))
    return samples


def process_kind(command: str) -> str:
    """A process named by what it is in the suite."""
    if "exec(eval(sys.stdin" in command:
        return "pytest worker"
    if re.search(r"pagedserve(\.service)? serve\b", command):
        return "pagedserve server"
    if "-m pytest" in command:
        return "pytest (main or nested)"
    words = command.split()
    script = next((w for w in words[1:] if w.endswith(".py") or w == "-c"), words[0] if words else "?")
    return os.path.basename(script) if script != "-c" else "python -c"


def function_name(frame: str) -> str:
    """`function (file)` without the line, so a function's samples add up across its lines."""
    name, _, where = frame.partition(" (")
    return f"{name} ({os.path.basename(where.rsplit(':', 1)[0])})" if where else name


@dataclass(slots=True)
class Summary:
    samples: int = 0
    by_kind: collections.Counter = field(default_factory=collections.Counter)
    by_test_file: collections.Counter = field(default_factory=collections.Counter)
    functions: dict[str, collections.Counter] = field(default_factory=lambda: collections.defaultdict(
        collections.Counter))

    def add(self, sample: Sample) -> None:
        kind = process_kind(sample.processes[-1]) if sample.processes else "?"
        self.samples += sample.count
        self.by_kind[kind] += sample.count
        if kind == "pytest worker":
            test = next((m.group(1) for f in sample.frames if (m := _TEST_FILE.search(f))), "(no test frame)")
            self.by_test_file[test] += sample.count
        for name in {function_name(f) for f in sample.frames}:  # inclusive: once per sample however deep
            self.functions[kind][name] += sample.count

    def report(self, rate: float, top: int) -> dict:
        seconds = lambda counter, n: {k: round(v / rate, 1) for k, v in counter.most_common(n)}  # noqa: E731
        return {"cpu_s": round(self.samples / rate, 1), "rate_hz": rate, "by_process_kind": seconds(self.by_kind, None),
                "by_test_file": seconds(self.by_test_file, top),
                "functions_inclusive_s": {kind: seconds(self._below_half(kind), top) for kind in self.functions
                                          if kind in ("pytest worker", "pagedserve server")}}

    def _below_half(self, kind: str) -> collections.Counter:
        """The kind's functions without the plumbing every stack passes through (pytest's and execnet's loops, the
        server's main): those in more than half of its samples."""
        half = self.by_kind[kind] / 2
        return collections.Counter({k: v for k, v in self.functions[kind].items() if v <= half})


def summarize(text: str) -> Summary:
    summary = Summary()
    for sample in parse(text):
        summary.add(sample)
    return summary


def record(out: Path, pytest_args: list[str]) -> int:
    spy = shutil.which("py-spy")
    if spy is None:
        sys.exit("py-spy not found: pip install py-spy==0.4.3")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    args = pytest_args or ["-n", "2", "--dist", "loadfile", "tests"]
    command = [spy, "record", "-r", str(RATE), "-f", "raw", "-o", str(out), "--subprocesses", "--nonblocking", "--",
               sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir=.", *args]
    return subprocess.run(command, cwd=ROOT, env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run pytest under py-spy")
    rec.add_argument("out", type=Path)
    rec.add_argument("pytest_args", nargs=argparse.REMAINDER)
    rep = sub.add_parser("report", help="sum a recorded profile (JSON on stdout)")
    rep.add_argument("profile", type=Path)
    rep.add_argument("--top", type=int, default=40)
    rep.add_argument("--rate", type=float, default=RATE, help="the rate it was recorded at (samples a second)")
    args = parser.parse_args()
    if args.command == "record":
        return record(args.out, args.pytest_args)
    text = args.profile.read_text(errors="replace")
    print(json.dumps(summarize(text).report(args.rate, args.top), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
