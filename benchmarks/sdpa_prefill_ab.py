"""SDPA prefill chunks over a cached past: two flash calls merged by their log-sum-exps (this tree) against the one
masked call they replaced, alternated in one process (never in CI).

Where SDPA takes prefill chunks (every chunk of 64 x 64 and more on an AVX2 build, long chunks of fp32 queries on
any tier) a chunk after cached context (a long prompt's second chunk, the rest of a prompt after a prefix-cache
hit, a preempted sequence computed again) carried a boolean [new, keys] mask. `--grid`: one layer's attention on
SmolLM2-135M's shapes (9 query heads, 3 KV heads, head dim 64, fp32) over several (new tokens, cached keys), both
ways, median ms. `--engine`: the default model prefilling a `--context`-token prompt (chunks of the engine's
default 2,048) per cache dtype, the split on and off alternately, `--rounds` times, ms per prompt token;
`--prefix-hit CACHED NEW`: a prompt whose first CACHED tokens the prefix cache holds, ms per new token. Prints one
JSON object per line; `--json` keeps them with the host.

    PAGEDSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python benchmarks/sdpa_prefill_ab.py --grid --engine --prefix-hit 3600 400 --kv bf16 int8 fp8 --rounds 4
    python benchmarks/sdpa_prefill_ab.py --engine --dtype float32 --kv auto int8 --rounds 4   # an AVX-512 host, fp32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
from fp8_kv_accuracy import host_info  # noqa: E402
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedserve.kernels import prefill_attention  # noqa: E402

# (new tokens, cached keys): the shapes kernels/prefill_attention.py's thresholds were chosen on, and shapes they
# were confirmed on afterwards.
CHOSEN_ON = ((8, 1024), (16, 2048), (64, 1024), (200, 1000), (512, 512), (512, 3584), (952, 2048), (2048, 2048),
             (1024, 7168), (24, 4096), (32, 512), (32, 4096), (48, 2048), (64, 64), (96, 4000), (128, 256),
             (128, 2048), (300, 6000), (20, 3500), (40, 1600), (100, 600), (256, 256), (12, 6000), (80, 900),
             (48, 1400), (160, 400), (1500, 500), (3000, 1000), (64, 4100), (300, 600), (400, 400), (180, 1200),
             (700, 300), (256, 1024), (2048, 300), (1024, 1024), (90, 3000), (600, 200), (512, 100), (30, 3000),
             (150, 900), (60, 2500), (200, 2000), (120, 700), (800, 800), (40, 8000), (350, 1500), (100, 300),
             (10, 9000), (768, 100), (768, 768), (900, 50), (1200, 200), (2000, 100), (1000, 3000), (3500, 500),
             (640, 2000), (700, 700))
CONFIRMED_ON = ((200, 6000), (400, 3000), (128, 9000), (600, 1500), (300, 4000), (700, 900), (100, 9000), (500, 1500),
                (256, 4096), (450, 2500))
SPLIT = prefill_attention._FLASH_CPU


def median_ms(call, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def grid() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape_set, new, past in [("chosen on", *x) for x in CHOSEN_ON] + [("confirmed on", *x) for x in CONFIRMED_ON]:
        q = torch.randn(new, 9, 64, generator=gen).transpose(0, 1).unsqueeze(0)  # the engine's strides
        k, v = (torch.randn(1, 3, past + new, 64, generator=gen) for _ in range(2))

        def masked():  # what the plan builds for such a chunk, once per step
            visible = prefill_attention._visible(past, past + new, 0, None, torch.device("cpu"))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.125, enable_gqa=True)

        def split():
            return prefill_attention._past_then_causal(q, k, v, 0.125, past)

        diff = (masked() - split()).abs().max().item()
        m, s = median_ms(masked), median_ms(split)
        rule = prefill_attention._split_past(torch.device("cpu"), new, past + new)
        rows.append({"case": "one layer", "set": shape_set, "new": new, "past": past, "masked_ms": round(m, 3),
                     "split_ms": round(s, 3), "split_vs_masked": round(s / m, 3), "max_abs_diff": diff,
                     "rule_takes": "split" if rule else "masked", "rule_vs_masked": round(s / m if rule else 1.0, 3)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def prefill_ms_per_token(engine: LLMEngine, prompt: list[int], tag: str) -> float:
    engine.add_request(tag, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - t0) / len(prompt) * 1e3


def engine_ab(kvs: list[str], dtype: str, context: int, rounds: int) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for kv in kvs:
        engine = LLMEngine(EngineConfig(kv_cache_dtype=kv, dtype=dtype, enable_prefix_caching=False,
                                        kv_cache_memory=400 << 20))  # an fp32 cache holds a 4k prompt too
        prefill_ms_per_token(engine, [rng.randrange(200, 20000) for _ in range(context)], "warm")  # FP8 calibrates
        times: dict[str, list[float]] = {"split": [], "masked": []}
        for r in range(rounds):
            for mode in ("split", "masked") if r % 2 == 0 else ("masked", "split"):
                prefill_attention._FLASH_CPU = SPLIT if mode == "split" else None
                prompt = [rng.randrange(200, 20000) for _ in range(context)]
                times[mode].append(prefill_ms_per_token(engine, prompt, f"{mode}-{r}"))
        prefill_attention._FLASH_CPU = SPLIT
        split, masked = statistics.median(times["split"]), statistics.median(times["masked"])
        rows.append({"case": "engine prefill", "kv_cache_dtype": engine.stats().kv_cache_dtype, "dtype": dtype,
                     "context": context,
                     "split_ms_per_token": round(split, 4), "masked_ms_per_token": round(masked, 4),
                     "split_vs_masked": round(split / masked, 3), "rounds": times})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def prefix_hit_ab(kvs: list[str], dtype: str, past: int, new: int, rounds: int) -> list[dict]:
    """A prompt whose first `past` tokens are in the prefix cache (a conversation's history): ms per new token of
    the rest, the split on and off alternately."""
    rng = random.Random(1)
    rows = []
    for kv in kvs:
        engine = LLMEngine(EngineConfig(kv_cache_dtype=kv, dtype=dtype, kv_cache_memory=400 << 20))
        times: dict[str, list[float]] = {"split": [], "masked": []}
        for r in range(rounds + 1):  # round 0 warms up (FP8 calibrates on it)
            for mode in ("split", "masked") if r % 2 == 0 else ("masked", "split"):
                prefill_attention._FLASH_CPU = SPLIT if mode == "split" else None
                history = [rng.randrange(200, 20000) for _ in range(past)]
                prefill_ms_per_token(engine, history, f"history-{mode}-{r}")
                ms = prefill_ms_per_token(engine, history + [rng.randrange(200, 20000) for _ in range(new)],
                                          f"{mode}-{r}") * (past + new) / new
                if r:
                    times[mode].append(ms)
        prefill_attention._FLASH_CPU = SPLIT
        split, masked = statistics.median(times["split"]), statistics.median(times["masked"])
        rows.append({"case": "engine prefix hit", "kv_cache_dtype": engine.stats().kv_cache_dtype, "dtype": dtype,
                     "cached": past, "new": new, "split_ms_per_new_token": round(split, 4),
                     "masked_ms_per_new_token": round(masked, 4), "split_vs_masked": round(split / masked, 3),
                     "rounds": times})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", action="store_true")
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--kv", nargs="+", default=["bf16", "int8", "fp8"])
    parser.add_argument("--dtype", default="auto", help="compute dtype (the split takes fp32 queries only)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--prefix-hit", type=int, nargs=2, metavar=("CACHED", "NEW"),
                        help="also a prompt of CACHED tokens found in the prefix cache and NEW ones after them")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--label", default="", help="e.g. 'noisy' when other jobs share the machine")
    parser.add_argument("--json")
    args = parser.parse_args()
    if SPLIT is None:
        sys.exit("this torch has no CPU flash attention op: nothing to compare")
    rows = grid() if args.grid else []
    if args.engine:
        rows += engine_ab(args.kv, args.dtype, args.context, args.rounds)
    if args.prefix_hit:
        rows += prefix_hit_ab(args.kv, args.dtype, *args.prefix_hit, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps({**host_info(), "label": args.label, "args": vars(args), "rows": rows},
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
