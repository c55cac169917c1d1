"""Per-token cost of each KV cache dtype on one long sequence: the prefill of a long prompt (per prompt token) and the
decode that follows (per generated token, at that context length), default model and backends. Cache dtypes are
interleaved round by round (A B C A B C ...) so that a busy host's drift lands on all of them alike; the median
round is reported, and each 8-bit dtype's ratio to the first (16-bit) one.

    python benchmarks/kv_dtype_speed.py --context 4096 --rounds 3 --json speed.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
from fp8_kv_accuracy import host_info  # noqa: E402
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def one_round(engine: LLMEngine, prompt: list[int], decode_tokens: int, tag: str) -> tuple[float, float]:
    """(seconds per prompt token of the prefill, seconds per generated token after the first)."""
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True)
    engine.add_request(tag, prompt, params)
    t0 = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(o.outputs and o.outputs[0].token_ids for o in outs):
            first = time.perf_counter()
    end = time.perf_counter()
    return (first - t0) / len(prompt), (end - first) / decode_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv", nargs="+", default=["bf16", "int8", "fp8"])
    parser.add_argument("--dtype", default="auto", help="compute dtype")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--label", default="", help="e.g. 'noisy' when other jobs share the machine")
    parser.add_argument("--json")
    args = parser.parse_args()
    rng = random.Random(0)
    engines = {kv: LLMEngine(EngineConfig(kv_cache_dtype=kv, dtype=args.dtype, enable_prefix_caching=False,
                                          kv_cache_memory=160 << 20)) for kv in args.kv}
    times: dict[str, list[tuple[float, float]]] = {kv: [] for kv in args.kv}
    for r in range(args.rounds + 1):  # round 0 warms up (FP8 calibrates on it)
        prompt = [rng.randrange(200, 20000) for _ in range(args.context)]
        for kv, engine in engines.items():
            result = one_round(engine, prompt, args.decode_tokens, f"{kv}-{r}")
            if r:
                times[kv].append(result)
                print(f"round {r} {kv:8} prefill {result[0] * 1e3:.3f} ms/token  decode {result[1] * 1e3:.2f} "
                      f"ms/token", flush=True)
    rows = []
    for kv in args.kv:
        prefill = statistics.median(t[0] for t in times[kv])
        decode = statistics.median(t[1] for t in times[kv])
        rows.append({"kv_cache_dtype": engines[kv].stats().kv_cache_dtype, "context": args.context,
                     "prefill_ms_per_token": prefill * 1e3, "decode_ms_per_token": decode * 1e3,
                     "rounds": [{"prefill_ms_per_token": p * 1e3, "decode_ms_per_token": d * 1e3} for p, d in times[kv]]})
    for row in rows:
        row["prefill_vs_first"] = row["prefill_ms_per_token"] / rows[0]["prefill_ms_per_token"]
        row["decode_vs_first"] = row["decode_ms_per_token"] / rows[0]["decode_ms_per_token"]
        print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({**host_info(), "label": args.label, "args": vars(args),
                                               "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
