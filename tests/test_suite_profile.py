"""benchmarks/suite_profile.py reads py-spy's raw (folded) output as py-spy 0.4 writes it with --subprocesses: each
sample a chain of `process PID:"command line"` frames, then the innermost process's stack, then a count; a command
line may hold ';' and newlines (a `python -c` script), which must not cut a sample apart."""

from __future__ import annotations

import json
import subprocess
import sys

import bench_paths  # noqa: F401  (benchmarks/ on sys.path)
from suite_profile import parse, process_kind, summarize

MAIN = 'process 10:"/venv/bin/python -P -m pytest -q -n 2 tests"'
WORKER = 'process 11:"/venv/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))"'
SERVER = 'process 12:"/venv/bin/python -m pagedserve.service serve --port 0"'
SCRIPT = 'process 13:"/venv/bin/python -c import json, sys\nfor path in sys.argv[1:]:\n    print(path)"'
LOOP = "serve (execnet/gateway_base.py:1)"
RAW = "\n".join([
    f"{MAIN};{WORKER};{LOOP};test_a (tests/test_alpha.py:10);build_engine (pagedserve/engine/build.py:101);"
    "zeroed_bytes (pagedserve/kernels/huge_pages.py:50) 7",
    f"{MAIN};{WORKER};{LOOP};test_a (tests/test_alpha.py:11);build_engine (pagedserve/engine/build.py:99) 3",
    f"{MAIN};{WORKER};{LOOP};test_b (test_beta.py:5) 12",
    f"{MAIN};{WORKER};{LOOP};pytest_collection (_pytest/main.py:1) 1",
    f"{MAIN};{WORKER};{SERVER};main (pagedserve/service/entry.py:1);step (pagedserve/engine/llm_engine.py:9) 20",
    f"{MAIN};{WORKER};{SCRIPT};<module> (<string>:2) 4",
    "",
])


def test_samples_keep_multiline_command_lines_whole():
    samples = parse(RAW)
    assert [s.count for s in samples] == [7, 3, 12, 1, 20, 4]
    assert [len(s.processes) for s in samples] == [2, 2, 2, 2, 3, 3]
    assert samples[5].processes[-1].startswith("/venv/bin/python -c import json, sys for path in")
    assert samples[5].frames == ("<module> (<string>:2)",)
    assert samples[0].frames[-1] == "zeroed_bytes (pagedserve/kernels/huge_pages.py:50)"


def test_process_kinds():
    kinds = [process_kind(s.processes[-1]) for s in parse(RAW)]
    assert kinds == ["pytest worker"] * 4 + ["pagedserve server", "python -c"]
    assert process_kind("/venv/bin/python tests/gpu/e2e_check.py --out x") == "e2e_check.py"
    assert process_kind("/venv/bin/pagedserve serve --http-port 0") == "pagedserve server"


def test_sums_by_kind_test_file_and_function():
    report = summarize(RAW).report(rate=1, top=10)
    assert report["cpu_s"] == 47
    assert report["by_process_kind"] == {"pytest worker": 23, "pagedserve server": 20, "python -c": 4}
    assert report["by_test_file"] == {"test_beta.py": 12, "test_alpha.py": 10, "(no test frame)": 1}
    worker = report["functions_inclusive_s"]["pytest worker"]
    # a function's lines add up; the loop every worker sample passes through is left out as plumbing
    assert worker["build_engine (build.py)"] == 10 and worker["zeroed_bytes (huge_pages.py)"] == 7
    assert "serve (gateway_base.py)" not in worker


def test_report_command_prints_json(tmp_path):
    profile = tmp_path / "profile.txt"
    profile.write_text(RAW)
    out = subprocess.run([sys.executable, str(bench_paths.BENCH / "suite_profile.py"), "report", str(profile),
                          "--rate", "2"], capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["cpu_s"] == 23.5
