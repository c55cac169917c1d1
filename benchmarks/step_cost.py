"""Does an engine step cost more late in a long generation than early? (Never in CI.)

    python benchmarks/step_cost.py                       # batch 32, steps around output position 16 vs 2048
    python benchmarks/step_cost.py --logprobs 1 --threads 2

A tiny random Llama (from a transformers config, the default model's tokenizer) decodes a batch of requests in
lockstep, greedy with ignore_eos, so step k is output position k for every request. Each step is split by wrapping
this engine's own components: `model` (runner.forward: inputs, attention plan, forward, logits), `sample`
(sampler) and `bookkeeping`, the rest of step() (scheduling, appending tokens, detokenizing, stop checks, building
the outputs). Attention reads the whole context, so `model` may grow with the position; `bookkeeping` must not: a
step that copied every request's token and logprob history into its outputs grew with it.

Prints one JSON object: per window (median and p90 ms of steps whose output position lies in it) and the machine
(CPU model from /proc/cpuinfo, usable cores, load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def tiny_llama(folder: Path, max_positions: int) -> Path:
    import transformers

    from pagedserve.engine.loading.model_store import resolve_model

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False, eos_token_id=2,
        bos_token_id=1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder, safe_serialization=True)
    source = resolve_model(None).tokenizer_dir
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((source / name).read_bytes())
    return folder


class StepClock:
    """Wall time of each step and of the model and sampler calls inside it, on this engine instance only."""

    def __init__(self, engine) -> None:
        self.inner = {"model": 0.0, "sample": 0.0}
        self.steps: list[dict[str, float]] = []
        self._wrap(engine.runner, "forward", "model")
        self._wrap(engine.runner, "sampler", "sample")
        self.engine, self._step = engine, engine.step

    def _wrap(self, owner, attr: str, label: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.inner[label] += time.perf_counter() - t0

        setattr(owner, attr, timed)

    def step(self) -> None:
        self.inner = {"model": 0.0, "sample": 0.0}
        t0 = time.perf_counter()
        self._step()
        total = time.perf_counter() - t0
        self.steps.append({"step": total, **self.inner, "bookkeeping": total - sum(self.inner.values())})


def run(args: argparse.Namespace, folder: Path) -> list[dict[str, float]]:
    from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
    from pagedserve.engine.host.tuning import tune_host

    length = args.late + args.window
    context = args.prompt_tokens + length + 8
    per_token = 2 * 2 * 16 * 2 * 4  # layers x KV heads x head dim x (K, V) x fp32 bytes
    config = EngineConfig(
        model=str(folder), dtype="float32", max_model_len=context, max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.batch * args.prompt_tokens), enable_prefix_caching=False,
        kv_cache_memory=2 * args.batch * context * per_token, num_threads=args.threads)
    engine = LLMEngine(config, governor=tune_host(config))
    params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True, logprobs=args.logprobs)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [100 + (7 * i + j) % 30000 for j in range(args.prompt_tokens)], params)
    clock = StepClock(engine)
    clock.step()  # the prefill step samples output position 1
    while engine.has_unfinished_requests():
        clock.step()
    return clock.steps


def window(steps: list[dict[str, float]], start: int, size: int) -> dict[str, dict[str, float]]:
    """Steps that sampled output positions start .. start + size - 1 (steps[k] samples position k + 1)."""
    chosen = steps[start - 1 : start - 1 + size]
    return {part: {"median_ms": round(1e3 * statistics.median(s[part] for s in chosen), 3),
                   "p90_ms": round(1e3 * statistics.quantiles([s[part] for s in chosen], n=10)[-1], 3)}
            for part in ("step", "model", "sample", "bookkeeping")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--early", type=int, default=16, help="first output position of the early window")
    parser.add_argument("--late", type=int, default=2048, help="first output position of the late window")
    parser.add_argument("--window", type=int, default=32, help="steps per window")
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--logprobs", type=int, default=None, help="top logprobs per token (default: none)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_llama(Path(tmp), max_positions=args.prompt_tokens + args.late + args.window + 64)
        t0 = time.perf_counter()
        steps = run(args, folder)
        wall = time.perf_counter() - t0
    early, late = window(steps, args.early, args.window), window(steps, args.late, args.window)
    growth = {part: round(late[part]["median_ms"] - early[part]["median_ms"], 3) for part in early}
    print(json.dumps({
        "benchmark": "step_cost", "batch": args.batch, "logprobs": args.logprobs, "steps": len(steps),
        "windows": {f"position_{args.early}": early, f"position_{args.late}": late},
        "late_minus_early_median_ms": growth, "wall_s": round(wall, 1),
        "cpu_model": cpu_model(), "usable_cores": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
    }, indent=2))


if __name__ == "__main__":
    main()
