"""What FP8 KV buys under a fixed KV budget: the longest context, the most concurrent 2,000-token requests, and the
throughput at that concurrency, 16-bit KV vs FP8 KV, on the default model and the engine's default backends.

Nothing is computed from formulas alone: the longest context is the largest prompt the engine admits (one block
more is refused with CapacityError) and is actually run; the concurrency is the number of 2,000-token requests the
block count holds, all submitted at once, and the engine's peak running count is reported beside it.

    python benchmarks/fp8_kv_capacity.py --kv-cache-memory 128MiB --json capacity.json   # quiet machine: ~10 min
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
from fp8_kv_accuracy import host_info  # noqa: E402
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedserve.engine.errors import CapacityError  # noqa: E402
from pagedserve.service.cli import parse_bytes  # noqa: E402


def make_engine(kv: str, memory: int, max_num_seqs: int) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_dtype=kv, kv_cache_memory=memory, max_num_seqs=max_num_seqs))


def run_all(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for n, prompt in enumerate(prompts):
        engine.add_request(f"r{n}", prompt, params)
    peak = finished = 0
    while engine.has_unfinished_requests():
        finished += sum(o.finished for o in engine.step())
        peak = max(peak, engine.stats().num_running)
    seconds = time.perf_counter() - t0
    stats = engine.stats()
    return {"seconds": seconds, "peak_running": peak, "finished": finished, "preemptions": stats.num_preemptions,
            "output_tokens": len(prompts) * max_tokens, "output_tokens_per_s": len(prompts) * max_tokens / seconds,
            "total_tokens_per_s": sum(len(p) + max_tokens for p in prompts) / seconds}


def longest_context(engine: LLMEngine) -> dict:
    """The largest prompt (+1 generated token) the engine admits under its KV budget, run once to prove it."""
    stats = engine.stats()
    limit = min(stats.num_kv_blocks * stats.block_size, stats.max_model_len) - 1
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    refused = False
    try:
        engine.add_request("too-long", [100] * (limit + stats.block_size), params)
    except CapacityError:
        refused = True
    while engine.has_unfinished_requests():
        engine.step()
    t0 = time.perf_counter()
    result = run_all(engine, [[100 + (i % 1000) for i in range(limit)]], 1)
    return {"longest_prompt_tokens": limit, "bounded_by": "kv budget" if limit + 1 < stats.max_model_len else
            "max_model_len", "one_block_more_refused": refused, "prefill_seconds": time.perf_counter() - t0,
            "ran": result["finished"] == 1}


def measure(kv: str, memory: int, request_tokens: int, output_tokens: int) -> dict:
    probe = make_engine(kv, memory, 256)
    stats = probe.stats()
    per_request = -(-request_tokens // stats.block_size)
    concurrency = stats.num_kv_blocks // per_request
    row = {"kv_cache_dtype": kv, "kv_cache_memory": memory, "blocks": stats.num_kv_blocks,
           "tokens": stats.num_kv_blocks * stats.block_size, "concurrent_requests": concurrency,
           **longest_context(probe)}
    del probe
    engine = make_engine(kv, memory, max(concurrency, 1))
    prompt_len = request_tokens - output_tokens
    prompts = [[200 + (7 * n + i) % 5000 for i in range(prompt_len)] for n in range(concurrency)]
    row.update(run_all(engine, prompts, output_tokens))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=128 << 20)
    parser.add_argument("--request-tokens", type=int, default=2000, help="prompt + generated tokens per request")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--kv", nargs="+", default=["auto", "fp8_e4m3"])
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [measure(kv, args.kv_cache_memory, args.request_tokens, args.output_tokens) for kv in args.kv]
    result = {**host_info(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
