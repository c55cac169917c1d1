"""The device check's one JSON report (OUT_DIR/report.json): device, versions, every stage, benchmark numbers.

device_check.sh records each stage's exit code and duration in its work folder, and the stage programs write their
details there (e2e.json, server.json, bench.json; the kernel stage's pytest writes kernels.xml). `assemble` gathers
whatever exists into report.json, so a stage that failed or hung still gets its entry. docs/gpu.md explains every
field; tests/test_device_check.py checks that a dry run fills all of REPORT_FIELDS.

    python3 tests/gpu/report.py assemble WORK_DIR OUT_DIR [--dry-run]
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

STAGES = ("install", "kernels", "e2e", "server", "bench", "decode")
REPORT_FIELDS = ("schema", "dry_run", "created_utc", "total_s", "device", "versions", "stages", "benchmarks")
DEVICE_FIELDS = ("name", "capability", "memory_gib", "multiprocessors", "driver")
VERSION_FIELDS = ("python", "torch", "torch_cuda", "triton", "transformers", "grpcio", "protobuf", "pagedserve_from")
STAGE_FIELDS = ("status", "exit_code", "duration_s", "budget_s", "log", "details")
BENCH_FIELDS = ("copy_gb_s", "decode_attention", "decode_attention_best_fraction", "decode_attention_target",
                "dequant_gemm", "w4a16_gemm", "e2e_tokens_per_s", "e2e_tokens_per_s_eager", "e2e_tokens_per_s_async",
                "decode_1b")
TIMEOUT_CODES = (124, 137)  # timeout(1): budget reached; killed after the grace period
LOG_TAIL_CHARS = 3000


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=1, sort_keys=True, default=str) + "\n")


def _version(module: str) -> str | None:
    try:
        return getattr(__import__(module, fromlist=["__version__"]), "__version__", "?")
    except Exception as exc:  # a broken install is a finding, not a crash of the report
        return f"unimportable: {type(exc).__name__}: {exc}"


def versions() -> dict:
    out = {"python": platform.python_version()}
    for field, module in (("torch", "torch"), ("triton", "triton"), ("transformers", "transformers"),
                          ("grpcio", "grpc"), ("protobuf", "google.protobuf")):
        out[field] = _version(module)
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda
    except Exception:
        out["torch_cuda"] = None
    try:
        import pagedserve.engine

        out["pagedserve_from"] = str(Path(pagedserve.engine.__file__).parent.parent)
    except Exception as exc:
        out["pagedserve_from"] = f"unimportable: {exc}"
    return out


def device() -> dict:
    info = dict.fromkeys(DEVICE_FIELDS)
    try:
        import torch

        if not torch.cuda.is_available():
            return {**info, "name": f"cpu ({platform.processor() or platform.machine()}): no CUDA device"}
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
    except Exception as exc:
        return {**info, "name": f"unknown: {exc}"}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["driver"] = smi.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def junit_details(path: Path) -> dict:
    """Counts and the failing test ids (with the first line of each failure) from pytest's junit XML. A stage stopped
    by its budget (SIGINT) leaves one nameless, childless testcase per test it interrupted: `interrupted`, not
    passed."""
    if not path.exists():
        return {"error": f"{path.name} was not written"}
    root = ET.parse(path).getroot()
    counts = dict.fromkeys(("tests", "passed", "failed", "errors", "skipped", "interrupted"), 0)
    failures = []
    for case in root.iter("testcase"):
        if case.get("name") is None:
            counts["interrupted"] += 1
            continue
        counts["tests"] += 1
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
            continue
        counts[{"failure": "failed", "error": "errors", "skipped": "skipped"}[outcome.tag]] += 1
        if outcome.tag != "skipped":
            message = (outcome.get("message") or outcome.text or "").strip().splitlines()
            failures.append(f"{case.get('classname')}::{case.get('name')}: {message[0][:300] if message else ''}")
    return {**counts, "failures": failures}


def stage_entry(name: str, work: Path, out: Path) -> dict:
    record_path = work / f"{name}.status.json"
    if not record_path.exists():
        return {"status": "not_run", "exit_code": None, "duration_s": None, "budget_s": None, "log": None,
                "details": {}}
    record = json.loads(record_path.read_text())
    code = record["exit_code"]
    status = "passed" if code == 0 else "timeout" if code in TIMEOUT_CODES else "failed"
    log = out / f"{name}.log"
    if name == "kernels":
        details = junit_details(work / "kernels.xml")
    elif name == "install":  # install.sh reports in its log, one "install: ..." line a step
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        details = {"steps": [line for line in lines if line.startswith(("install:", "Python"))]}
    else:
        details_path = work / f"{name}.json"
        details = json.loads(details_path.read_text()) if details_path.exists() else {"error": "no details written"}
    if status != "passed" and log.exists():
        details["log_tail"] = log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    return {"status": status, "exit_code": code, "duration_s": record["duration_s"], "budget_s": record["budget_s"],
            "log": log.name, "details": details}


def benchmarks(bench: dict, decode: dict) -> dict:
    """bench.json's numbers, and decode.json's summary (the 1B-shaped model's ratios) as `decode_1b`."""
    return {**{field: bench.get(field) for field in BENCH_FIELDS}, "decode_1b": decode.get("summary")}


def assemble(work: Path, out: Path, dry_run: bool) -> dict:
    started = json.loads((work / "started.json").read_text()) if (work / "started.json").exists() else {}
    now = datetime.datetime.now(datetime.timezone.utc)
    stages = {name: stage_entry(name, work, out) for name in STAGES}
    report = {
        "schema": 1,
        "dry_run": dry_run,
        "created_utc": now.isoformat(timespec="seconds"),
        "total_s": round(now.timestamp() - started.get("epoch", now.timestamp()), 1),
        "device": device(),
        "versions": versions(),
        "stages": stages,
        "benchmarks": benchmarks(stages["bench"]["details"], stages["decode"]["details"]),
    }
    write_json(out / "report.json", report)
    return report


def summary(report: dict) -> str:
    lines = [f"device: {report['device']['name']}  dry_run: {report['dry_run']}  total: {report['total_s']} s"]
    for name, stage in report["stages"].items():
        counts = stage["details"] if name == "kernels" and "tests" in stage["details"] else None
        tally = "" if counts is None else (f": {counts['passed']} passed, {counts['failed']} failed, "
                                           f"{counts['errors']} errors, {counts['interrupted']} interrupted")
        lines.append(f"  {name:8} {stage['status']:8} {stage['duration_s']} s (budget {stage['budget_s']} s){tally}")
    bench = report["benchmarks"]
    lines.append(f"  copy {bench['copy_gb_s']} GB/s; decode attention best "
                 f"{bench['decode_attention_best_fraction']} of "
                 f"copy (target {bench['decode_attention_target']}); e2e {bench['e2e_tokens_per_s']} tokens/s "
                 f"({bench['e2e_tokens_per_s_eager']} eager, {bench.get('e2e_tokens_per_s_async')} async scheduling)")
    decode = bench["decode_1b"] or {}
    lines.append(f"  1B-shaped decode: GPTQ/fp16 {decode.get('gptq_vs_fp16')}, AWQ/fp16 {decode.get('awq_vs_fp16')} "
                 f"(target {decode.get('target_4bit_vs_fp16')}); graphs on/off {decode.get('graphs_vs_eager')}; "
                 f"async scheduling on/off {decode.get('async_vs_graphs')}")
    lines.append(f"  1B-shaped batch-1 graphed step, ms (wall, host, device): {decode.get('host_split_batch1')}")
    lines.append(f"  w4a16 (rule) worst speedup vs fp16 by M: {w4a16_worst(bench.get('w4a16_gemm'))}")
    return "\n".join(lines)


def w4a16_worst(rows: list[dict] | None) -> dict[int, float | None]:
    """Per M, the lowest speedup_vs_fp16 of what the engine runs (w4a16_rule) over the benched shapes."""
    worst: dict[int, float | None] = {}
    for row in rows or ():
        got = row["candidates"].get("w4a16_rule", {}).get("speedup_vs_fp16")
        prev = worst.get(row["m"])
        worst[row["m"]] = got if prev is None or got is None else min(prev, got)
    return worst


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4) or argv[0] != "assemble":
        print(__doc__, file=sys.stderr)
        return 2
    report = assemble(Path(argv[1]), Path(argv[2]), dry_run=argv[3:] == ["--dry-run"])
    print(summary(report))
    # not_run alone is no failure: DEVICE_CHECK_STAGES left the stage out (when install fails, install is failed)
    return 1 if any(s["status"] in ("failed", "timeout") for s in report["stages"].values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
