"""The engine's admission rule against the one before it (admission_replay.py's WholePromptScheduler) on workloads
drawn at random rather than chosen: request count, prompt lengths, output length, early stop and cache size each
drawn per case, every case priced with long_context_model.py's per-tier step costs (Zen 4, AVX2, AMX host). Prints
one JSON line per case with the predicted time of the old rule over the engine's per tier (> 1: the engine is
faster), then a summary per cache-size band (worst, best, cases lost). Computed, not timed: the same `--seed`
prints the same lines on any host.

    python benchmarks/admission_sweep.py --cases 155 --seed 12345
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
from admission_replay import WholePromptScheduler  # noqa: E402
from kv_long_context import workload  # noqa: E402
from long_context_model import draw_stops, predicted_seconds  # noqa: E402
from pagedserve.engine.core.scheduler import Scheduler  # noqa: E402

# --step-ms, --row-ms, --prefill-ms-per-token, --attention-us-per-key of each tier's profile (docs/kv-cache-formats.md)
TIERS = {"zen4": (4.3, 0.0, 1.31, 1.44), "avx2": (6.2, 1.5, 2.34, 2.15), "amx": (4.1, 0.6, 0.322, 5.3e3 / 3585)}
BANDS = ((0, 32), (32, 64), (64, 256), (256, None))  # cache sizes in blocks of 16 tokens


def draw_case(rng: random.Random) -> dict:
    requests = rng.choice([4, 8, 16, 32, 64, 128])
    shortest = rng.choice([16, 64, 128, 512, 1024, 2048])
    longest = shortest * rng.choice([1, 2, 4])
    output = rng.choice([16, 64, 256, 1024, 2048])
    early = rng.choice([None, 0.05, 0.3, 0.7])
    need = (longest + output + 15) // 16  # the longest request's blocks: the cache must hold it
    blocks = rng.choice([need + 2, int(need * 1.5), need * 2, need * 4, need * 8])
    return {"requests": requests, "shortest": shortest, "longest": longest, "output": output, "early": early,
            "blocks": blocks, "seed": rng.randrange(100)}


def price(case: dict) -> dict:
    prompts = workload(case["requests"], case["shortest"], case["longest"], case["seed"])
    stops = draw_stops(len(prompts), case["output"], case["early"], case["seed"])
    row = dict(case)
    for tier, costs in TIERS.items():
        engine = predicted_seconds(case["blocks"], prompts, case["output"], *costs, Scheduler, stops)
        before = predicted_seconds(case["blocks"], prompts, case["output"], *costs, WholePromptScheduler, stops)
        row[tier] = round(before / engine, 4)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=155)
    parser.add_argument("--seed", type=int, default=12345)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    for _ in range(args.cases):
        rows.append(price(draw_case(rng)))
        print(json.dumps(rows[-1]), flush=True)
    for low, high in BANDS:
        band = [r for r in rows if r["blocks"] >= low and (high is None or r["blocks"] < high)]
        if band:
            print(json.dumps({"blocks": [low, high], "cases": len(band),
                              **{tier: {"worst": min(r[tier] for r in band), "best": max(r[tier] for r in band),
                                        "lost": sum(r[tier] < 0.999 for r in band)} for tier in TIERS}}))


if __name__ == "__main__":
    main()
