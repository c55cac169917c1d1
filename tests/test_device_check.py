"""The GPU device check (tests/gpu/device_check.sh) in its dry mode, so it cannot rot between GPU runs: every stage
runs on CPU under Triton's interpreter and writes the same report a GPU run writes; and the wheel list it carries to
the GPU machine stays pinned to versions pyproject.toml accepts."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _gpu_module(name: str) -> ModuleType:
    """tests/gpu/<name>.py under a name of its own: benchmarks/peers has a `report` module too, and whichever test
    imported its `report` first would otherwise hand the other its module."""
    spec = importlib.util.spec_from_file_location(f"device_check_{name}", ROOT / "tests" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


report = _gpu_module("report")
wheels = _gpu_module("wheels")

E2E_CASES = {"llama_fp32", "gemma3_fp32", "llama_bf16", "fp8_kv", "constrained", "lora", "gptq", "awq",
             "cuda_graphs_fp16", "cuda_graphs_bf16", "cuda_graphs_gptq", "sampling", "memory_utilization", "smollm2"}
SERVER_CHECKS = {"health", "protocols_agree", "concurrent_streams", "cancel_frees_blocks"}


# The dry run is one subprocess of 4-7 minutes on a slow 2-core host beside the other worker (the first test using
# the fixture pays for it): pytest-timeout's 600 s would leave it 1.5x, so the tests that read it get its own limit.
DRY_RUN_TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("device-check")
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)  # the check installs the tree into its own folder and imports it from there
    proc = subprocess.run(["bash", str(ROOT / "tests/gpu/device_check.sh"), "--dry-run", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S)
    assert (out / "report.json").exists(), proc.stdout + proc.stderr
    result = json.loads((out / "report.json").read_text())
    result["_stdout"], result["_exit"], result["_out"] = proc.stdout + proc.stderr, proc.returncode, out
    return result


@pytest.mark.slow
@pytest.mark.timeout(DRY_RUN_TIMEOUT_S + 60)
def test_dry_run_passes_every_stage(dry_report):
    assert dry_report["_exit"] == 0, dry_report["_stdout"]
    assert dry_report["dry_run"] is True
    for name in report.STAGES:
        stage = dry_report["stages"][name]
        assert set(report.STAGE_FIELDS) <= set(stage), name
        assert stage["status"] == "passed", (name, stage["details"])
        assert (dry_report["_out"] / stage["log"]).exists(), name


@pytest.mark.slow
@pytest.mark.timeout(DRY_RUN_TIMEOUT_S + 60)
def test_dry_run_report_has_every_field(dry_report):
    assert set(report.REPORT_FIELDS) <= set(dry_report)
    assert set(report.DEVICE_FIELDS) <= set(dry_report["device"])
    assert set(report.VERSION_FIELDS) <= set(dry_report["versions"])
    assert set(report.BENCH_FIELDS) == set(dry_report["benchmarks"])
    assert all(dry_report["benchmarks"][f] is not None for f in report.BENCH_FIELDS)
    # the stages imported pagedserve from the check's own install, not from wherever the host has it
    installed = dry_report["versions"]["pagedserve_from"]
    assert "device-check." in installed and installed.endswith("/pagedserve"), installed


@pytest.mark.slow
@pytest.mark.timeout(DRY_RUN_TIMEOUT_S + 60)
def test_dry_run_stage_details(dry_report):
    stages = dry_report["stages"]
    kernels = stages["kernels"]["details"]
    assert kernels["tests"] >= 200 and kernels["failed"] == kernels["errors"] == 0  # collected; skipped without CUDA
    cases = stages["e2e"]["details"]["cases"]
    assert set(cases) == E2E_CASES
    assert {n for n, c in cases.items() if c["status"] == "passed"} == E2E_CASES - {"smollm2"}
    assert "64 MiB" in cases["smollm2"]["reason"]
    assert cases["fp8_kv"]["blocks_fp8"] == 2 * cases["fp8_kv"]["blocks_bf16"]
    checks = stages["server"]["details"]["checks"]
    assert set(checks) == SERVER_CHECKS and all(c["status"] == "passed" for c in checks.values())
    assert stages["server"]["details"]["exit_code_after_sigterm"] == 0
    assert any(step.startswith("install: pagedserve into") for step in stages["install"]["details"]["steps"])
    decode = stages["decode"]["details"]
    assert sorted((r["weights"], r["mode"]) for r in decode["rows"]) == sorted(
        (kind, mode) for kind in ("fp16", "gptq", "awq") for mode in ("graphs", "async", "eager"))
    assert all(run["decode_tokens"] > 0 for r in decode["rows"] for run in r["runs"])
    assert all(r["lookahead_steps"] > 0 for r in decode["rows"] if r["mode"] == "async")
    graphed = {r["weights"]: r for r in decode["rows"] if r["mode"] == "graphs"}
    assert all(graphed[kind]["host_split_batch1"]["steps"] > 0 for kind in ("fp16", "gptq", "awq"))
    for kind in ("fp16", "gptq"):  # the step's profile and its kernels (CPU ops in a dry run)
        kernels = graphed[kind]["kernels_batch1"]
        assert kernels["steps"] > 0 and kernels["launches_per_step"] > 0 and kernels["top"], kernels
        assert graphed[kind]["host_profile_batch1"]
    ratios = dry_report["benchmarks"]["decode_1b"]
    assert ratios["target_4bit_vs_fp16"] == 1.8 and all(
        v is not None for key in ("gptq_vs_fp16", "awq_vs_fp16", "graphs_vs_eager", "async_vs_graphs")
        for v in ratios[key].values())
    one_row = [r for r in dry_report["benchmarks"]["w4a16_gemm"] if r["m"] == 1]
    for row in one_row:  # every split-K launch of the sweep ran (under the interpreter), none raised
        splitk = {name: c for name, c in row["candidates"].items() if name.startswith("splitk")}
        assert len(splitk) == 17 and all("ms" in c for c in splitk.values()), row
    for row in (r for r in dry_report["benchmarks"]["w4a16_gemm"] if r["m"] == 32):  # only the 32- and 64-row tiles
        splitk = {name: c for name, c in row["candidates"].items() if name.startswith("splitk")}
        assert len(splitk) == 4 and all("ms" in c and name.endswith(("_m32", "_m64")) for name, c in splitk.items())


def test_wheel_list_is_pinned_and_agrees_with_pyproject():
    pins = wheels.read_pins()
    assert pins and all(p.version[0].isdigit() for p in pins)
    requirements = wheels.project_requirements()
    wheels.check_against_pyproject(pins, requirements)
    for pin in pins:
        if pin.name in requirements:
            assert requirements[pin.name].specifier.contains(pin.version)


def test_wheel_list_checker_refuses_what_would_break_the_gpu_install(tmp_path):
    requirements = wheels.project_requirements()
    good = wheels.read_pins()
    wrong = [wheels.Pin(p.name, "0.0.1") if p.name == "grpcio" else p for p in good]
    with pytest.raises(wheels.WheelListError, match="grpcio==0.0.1 does not satisfy"):
        wheels.check_against_pyproject(wrong, requirements)
    with pytest.raises(wheels.WheelListError, match="neither carried"):
        wheels.check_against_pyproject([p for p in good if p.name != "gguf"], requirements)
    with pytest.raises(wheels.WheelListError, match="replaces the GPU image's own"):
        wheels.check_against_pyproject(good + [wheels.Pin("torch", "2.13.0")], {**requirements,
                                                                                  "torch": Requirement("torch")})
    unpinned = tmp_path / "wheels.txt"
    unpinned.write_text("gguf>=0.19\n")
    with pytest.raises(wheels.WheelListError, match="wheels.txt:1: 'gguf>=0.19' is not a pinned name==version"):
        wheels.read_pins(unpinned)


def test_wheel_folder_must_hold_exactly_the_listed_wheels(tmp_path):
    pins = [wheels.Pin("gguf", "0.19.0"), wheels.Pin("starlette", "1.10.0")]
    (tmp_path / "gguf-0.19.0-py3-none-any.whl").touch()
    with pytest.raises(wheels.WheelListError, match="one wheel of starlette==1.10.0"):
        wheels.wheel_files(pins, tmp_path)
    (tmp_path / "starlette-1.10.0-py3-none-any.whl").touch()
    assert [f.name for f in wheels.wheel_files(pins, tmp_path)] == ["gguf-0.19.0-py3-none-any.whl",
                                                                   "starlette-1.10.0-py3-none-any.whl"]
    (tmp_path / "uvicorn-0.54.0-py3-none-any.whl").touch()
    with pytest.raises(wheels.WheelListError, match="not in wheels.txt"):
        wheels.wheel_files(pins, tmp_path)


def test_a_kernel_stage_stopped_by_its_budget_keeps_what_finished(tmp_path):
    """device_check.sh stops a stage over budget with SIGINT: pytest then still writes its junit XML, and the report
    counts the test it cut off as interrupted, not passed; also when the check itself was started with SIGINT ignored
    (tests/gpu/default_sigint.py)."""
    started = tmp_path / "started"
    (tmp_path / "test_cut.py").write_text(
        "import pathlib, time\n\n\ndef test_finishes():\n    pass\n\n\n"
        f"def test_is_cut_off():\n    pathlib.Path({str(started)!r}).touch()\n    time.sleep(600)\n")
    xml = tmp_path / "kernels.xml"
    # started as a shell without job control starts a background job (SIGINT ignored), through the stages' wrapper
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/gpu/default_sigint.py"), sys.executable, "-m", "pytest",
                             "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--junitxml", str(xml), "test_cut.py"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        for _ in range(1200):  # at most 120 s for pytest to start and reach the second test
            if started.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert started.exists(), "the blocking test never started"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) != 0
    finally:
        proc.kill()
    details = report.junit_details(xml)
    assert {k: details[k] for k in ("tests", "passed", "failed", "errors", "skipped", "interrupted")} == {
        "tests": 1, "passed": 1, "failed": 0, "errors": 0, "skipped": 0, "interrupted": 1}
