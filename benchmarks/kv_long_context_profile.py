"""Where the long-context benchmark's time goes, per cache dtype (never in CI): the workload of kv_long_context.py
run once per dtype with every step timed by wrapping this engine's runner.execute.

Per dtype: the time in steps that prefill (any sequence with more than one new token; the decode rows riding along
counted with them) and in decode-only steps; the prompt tokens computed, and of them those computed again after a
preemption (`reprefilled_tokens`: every token prefilled minus the prompts); and decode attention's share of the
decode-only steps, measured by replaying it: after every `--replay-every`-th native decode step, the same rows
(contexts, block tables) go through the native decode attention of all layers' caches once more with fp32 queries,
as the C decode step calls it, timed apart from the step (`attention_seconds` scales the sample up to all decode
steps). A fit of step time to rows and keys was tried and is ill-conditioned here (rows and keys move together).

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
from pagedserve.kernels.cpu import native as cpu_native  # noqa: E402
from pagedserve.service.cli import parse_bytes  # noqa: E402


def timed_steps(engine: LLMEngine, replays: list[float]) -> list[dict]:
    """Wraps this engine's runner.execute: one record per step (kind, seconds, rows, keys, prefill tokens); the time
    of attention replays made inside the step (`replays`) is not counted."""
    records: list[dict] = []
    execute = engine.runner.execute

    def wrapped(batch):
        prefill = [s for s in batch.scheduled if s.num_new_tokens > 1]
        decode = [s for s in batch.scheduled if s.num_new_tokens == 1]
        t0, replayed = time.perf_counter(), sum(replays)
        out = execute(batch)
        seconds = time.perf_counter() - t0 - (sum(replays) - replayed)
        records.append({"prefill": bool(prefill), "seconds": seconds, "rows": len(decode),
                        "keys": sum(s.seq.num_computed_tokens + 1 for s in decode),
                        "prefill_tokens": sum(s.num_new_tokens for s in prefill),
                        "prefill_keys": sum(s.seq.num_computed_tokens + s.num_new_tokens for s in prefill)})
        return out

    engine.runner.execute = wrapped
    return records


def replay_attention(engine: LLMEngine, every: int) -> list[float]:
    """Wraps the native decode step: every `every`-th call, the step's decode attention replayed over all layers
    (seconds appended); the step's own result is untouched (the replay writes a scratch output)."""
    samples: list[float] = []
    native, cache = engine.runner.native_step, engine.runner.kv_cache
    if native is None:
        return samples
    run, calls = native.run, [0]
    heads, dim = engine.runner.model.args.num_heads, engine.runner.kv_spec.head_dim

    def wrapped(step):
        out = run(step)
        calls[0] += 1
        if calls[0] % every == 0:
            rows = len(step.seq_lens)
            batch = cpu_native.DecodeBatch(torch.arange(rows), torch.tensor(step.seq_lens, dtype=torch.int32),
                                           torch.tensor(step.row_block_tables, dtype=torch.int32),
                                           max(step.seq_lens))
            query = torch.randn(rows, heads, dim)
            scratch = torch.empty_like(query)
            t0 = time.perf_counter()
            for layer in cache.layers:
                cpu_native.decode_attention(query, scratch, layer, batch, dim**-0.5)
            samples.append(time.perf_counter() - t0)
        return out

    native.run = wrapped
    return samples


def profile(kv: str, memory: int, prompts: list[list[int]], output_tokens: int, every: int) -> dict:
    engine = LLMEngine(EngineConfig(kv_cache_dtype=kv, kv_cache_memory=memory))
    replays = replay_attention(engine, every)
    steps = timed_steps(engine, replays)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for n, prompt in enumerate(prompts):
        engine.add_request(f"r{n}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - t0 - sum(replays)  # the replays' own time is not the run's
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
            "outside_steps_seconds": seconds - prefill_s - decode_s,
            "attention_replays": len(replays), "attention_seconds": _scaled(replays, len(decode)),
            "attention_share_of_decode": _scaled(replays, len(decode)) / max(decode_s, 1e-9),
            "mean_rows_per_step": sum(s["rows"] for s in decode) / max(len(decode), 1),
            "mean_keys_per_row": sum(s["keys"] for s in decode) / max(sum(s["rows"] for s in decode), 1)}


def _scaled(samples: list[float], steps: int) -> float:
    return sum(samples) / len(samples) * steps if samples else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=128 << 20)
    parser.add_argument("--kv", nargs="+", default=["bf16", "int8", "fp8"])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--shortest", type=int, default=2048)
    parser.add_argument("--longest", type=int, default=4096)
    parser.add_argument("--output-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replay-every", type=int, default=4, help="decode steps per replayed attention sample")
    parser.add_argument("--label", default="", help="e.g. 'noisy' when other jobs share the machine")
    parser.add_argument("--json")
    args = parser.parse_args()
    prompts = workload(args.requests, args.shortest, args.longest, args.seed)
    rows = []
    for kv in args.kv:
        rows.append(profile(kv, args.kv_cache_memory, prompts, args.output_tokens, args.replay_every))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({**host_info(), "label": args.label, "args": vars(args),
                                               "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
