"""What does serving LoRA adapters cost? (Never in CI.)

    python benchmarks/lora_throughput.py                      # default model, 64 requests, repeats 3
    python benchmarks/lora_throughput.py --requests 64 --prompt-len 64 --max-tokens 64 --repeats 5

64 requests spread over 4 LoRA adapters and the base (request i uses adapter i % 5; 4 = the base), against the same
64 requests all on the base through an engine without LoRA: the same prompts, greedy, ignore_eos and fixed lengths,
so both runs do the same token work and differ only by the adapters. The adapters are the ones
benchmarks/peers/lora_vs_vllm.py serves (benchmarks/lora_adapters.py: made once by peft over the model's HF folder,
rank 16 on q/k/v/o/gate/up/down, random non-zero A and B). Runs
alternate (A/B), medians reported (and the median of each pair's ratio); target ratio (adapters / base) >= 0.85. Prints one JSON object with the machine
(CPU model, usable cores, load average before/after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
from contention import cpu_model  # noqa: E402
from hf_folder import hf_folder  # noqa: E402
from lora_adapters import benchmark_adapters  # noqa: E402
from pagedserve.engine import LLM, SamplingParams  # noqa: E402
from pagedserve.engine.lora.config import LoraConfig, LoraModule  # noqa: E402

NUM_ADAPTERS = 4


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, adapters: list[str | None]) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, adapter=adapters)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_before = os.getloadavg()
    base_llm = LLM(args.model)
    folders = benchmark_adapters(hf_folder(args.model), NUM_ADAPTERS, args.rank)
    modules = [LoraModule(folder.name, str(folder)) for folder in folders]
    lora = LoraConfig(modules=tuple(modules), max_loras=NUM_ADAPTERS, max_lora_rank=args.rank)
    lora_llm = LLM(args.model, lora=lora)
    g = torch.Generator().manual_seed(0)
    vocab = base_llm.engine.runner.vocab_size
    prompts = [torch.randint(100, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    names = [m.name for m in modules] + [None]
    mixed = [names[i % len(names)] for i in range(args.requests)]
    run(base_llm, prompts[:4], params, [None] * 4)  # warm-up: kernels compiled, allocator settled
    run(lora_llm, prompts[:4], params, mixed[:4])
    base, adapters = [], []
    for _ in range(args.repeats):
        base.append(run(base_llm, prompts, params, [None] * args.requests))
        adapters.append(run(lora_llm, prompts, params, mixed))
    result = {
        "benchmark": "lora_throughput", "cpu": cpu_model(), "usable_cores": len(os.sched_getaffinity(0)),
        "model": base_llm.engine.source.name, "dtype": str(base_llm.engine.loaded.dtype).removeprefix("torch."),
        "requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rank": args.rank,
        "adapters": NUM_ADAPTERS, "base_tok_s": statistics.median(base), "lora_tok_s": statistics.median(adapters),
        "ratio": statistics.median(adapters) / statistics.median(base), "target_ratio": 0.85,
        # each LoRA run over the base run just before it: drifts in the machine's load cancel within a pair
        "pair_ratio_median": statistics.median(a / b for a, b in zip(adapters, base)),
        "runs": {"base": base, "lora": adapters}, "load_before": load_before, "load_after": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
