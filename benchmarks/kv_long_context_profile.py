"""Where the long-context benchmark's time goes, per cache dtype (never in CI): the workload of kv_long_context.py
run once per dtype with every step timed by wrapping this engine's runner.execute.

Per dtype: the time in steps that prefill (any sequence with more than one new token; the decode rows riding along
counted with them) and in decode-only steps; the prompt tokens computed, and of them those computed again after a
preemption (`reprefilled_tokens`: every token prefilled minus the prompts); and decode attention's share of the
decode-only steps, from a least-squares fit of each step's time to W + w_n * rows + a * (keys its rows read): the
weights and per-row work do not grow with the context, attention does (a * keys), so the fit splits one from the
other without timing inside the C decode step.

    python benchmarks/kv_long_context_profile.py --kv-cache-memory 128MiB --requests 4 --shortest 2048 \
        --longest 4096 --output-tokens 1024 --json profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
from fp8_kv_accuracy import host_info  # noqa: E402
from kv_long_context import workload  # noqa: E402
from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedserve.service.cli import parse_bytes  # noqa: E402


def timed_steps(engine: LLMEngine) -> list[dict]:
    """Wraps this engine's runner.execute: one record per step (kind, seconds, rows, keys, prefill tokens)."""
    records: list[dict] = []
    execute = engine.runner.execute

    def wrapped(batch):
        prefill = [s for s in batch.scheduled if s.num_new_tokens > 1]
        decode = [s for s in batch.scheduled if s.num_new_tokens == 1]
        t0 = time.perf_counter()
        out = execute(batch)
        records.append({"prefill": bool(prefill), "seconds": time.perf_counter() - t0, "rows": len(decode),
                        "keys": sum(s.seq.num_computed_tokens + 1 for s in decode),
                        "prefill_tokens": sum(s.num_new_tokens for s in prefill),
                        "prefill_keys": sum(s.seq.num_computed_tokens + s.num_new_tokens for s in prefill)})
        return out

    engine.runner.execute = wrapped
    return records


def decode_fit(steps: list[dict]) -> dict:
    """t = W + w_n * rows + a * keys over the decode-only steps; attention = a * keys summed."""
    if len(steps) < 3:
        return {}
    x = torch.tensor([[1.0, s["rows"], s["keys"]] for s in steps], dtype=torch.float64)
    t = torch.tensor([s["seconds"] for s in steps], dtype=torch.float64)
    w, w_n, a = torch.linalg.lstsq(x, t[:, None]).solution[:, 0].tolist()
    keys = float(x[:, 2].sum())
    return {"fixed_ms_per_step": w * 1e3, "ms_per_row": w_n * 1e3, "attention_us_per_1k_keys": a * 1e6 * 1e3,
            "attention_seconds": a * keys, "attention_share_of_decode": a * keys / float(t.sum()),
            "mean_rows_per_step": float(x[:, 1].mean()), "mean_keys_per_row": keys / float(x[:, 1].sum())}


def profile(kv: str, memory: int, prompts: list[list[int]], output_tokens: int) -> dict:
    engine = LLMEngine(EngineConfig(kv_cache_dtype=kv, kv_cache_memory=memory))
    steps = timed_steps(engine)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for n, prompt in enumerate(prompts):
        engine.add_request(f"r{n}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - t0
    stats = engine.stats()
    prefill = [s for s in steps if s["prefill"]]
    decode = [s for s in steps if not s["prefill"]]
    prompt_tokens = sum(len(p) for p in prompts)
    prefilled = sum(s["prefill_tokens"] for s in prefill)
    prefill_s, decode_s = sum(s["seconds"] for s in prefill), sum(s["seconds"] for s in decode)
    return {"kv_cache_dtype": stats.kv_cache_dtype, "blocks": stats.num_kv_blocks, "seconds": seconds,
            "total_tokens_per_s": (prompt_tokens + len(prompts) * output_tokens) / seconds,
            "preemptions": stats.num_preemptions, "prompt_tokens": prompt_tokens, "prefilled_tokens": prefilled,
            "reprefilled_tokens": prefilled - prompt_tokens, "prefill_steps": len(prefill),
            "prefill_seconds": prefill_s, "prefill_ms_per_token": prefill_s / max(prefilled, 1) * 1e3,
            "decode_rows_in_prefill_steps": sum(s["rows"] for s in prefill), "decode_steps": len(decode),
            "decode_seconds": decode_s, "decode_ms_per_row": decode_s / max(sum(s["rows"] for s in decode), 1) * 1e3,
            "outside_steps_seconds": seconds - prefill_s - decode_s, **decode_fit(decode)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=128 << 20)
    parser.add_argument("--kv", nargs="+", default=["bf16", "int8", "fp8"])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--shortest", type=int, default=2048)
    parser.add_argument("--longest", type=int, default=4096)
    parser.add_argument("--output-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="e.g. 'noisy' when other jobs share the machine")
    parser.add_argument("--json")
    args = parser.parse_args()
    prompts = workload(args.requests, args.shortest, args.longest, args.seed)
    rows = []
    for kv in args.kv:
        rows.append(profile(kv, args.kv_cache_memory, prompts, args.output_tokens))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({**host_info(), "label": args.label, "args": vars(args),
                                               "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
