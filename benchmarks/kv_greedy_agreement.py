"""Greedy continuations with an 8-bit KV cache against the 16-bit cache, on real chat prompts: how many are token
for token identical, and where the others first differ. Default model and backends; each 8-bit cache is compared
with the 16-bit cache of the same compute dtype (fp16 KV for fp32 compute, bf16 KV for bf16). Both sides take the
same attention path (`--attention-backend`, default native: the C kernels and the C decode step on CPU); each row
records the implementation and whether the native decode step was on, for both sides.

    python benchmarks/kv_greedy_agreement.py --json greedy.json

The floor, what a harmless difference alone does to greedy text: `--kv` also takes 16-bit caches (a bf16 cache
against an fp16 one holds the prefill's bf16 K/V exactly and rounds only the decode step's fp32 rows differently),
and `--chunk-tokens N` adds a row with the reference cache itself, prefilled in chunks of N tokens:

    python benchmarks/kv_greedy_agreement.py --compute bfloat16 --kv int8 fp16 fp32 --chunk-tokens 16

Every run computes on a fixed number of threads (`--threads`, default all this process may use): the engine's
default thread governor drops a thread while other processes hold a core, and a bf16 run on another thread count
takes other summation orders in torch's matmuls, which alone made two runs of the very same bf16 configuration
agree on 7 of 20 prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
from fp8_kv_accuracy import REFERENCE_KV, host_info  # noqa: E402
from pagedserve.engine import LLM, SamplingParams  # noqa: E402

PROMPTS = (
    "What is the capital of Australia, and why was it chosen over Sydney and Melbourne?",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain the difference between TCP and UDP in three sentences.",
    "Give me a recipe for a simple tomato soup.",
    "Translate into French: The weather is lovely today, let's go for a walk.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What are the main causes of inflation?",
    "Write a haiku about autumn leaves.",
    "How do I reverse a linked list in C?",
    "List five tips for better sleep.",
    "What does the git rebase command do?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a short, polite email declining a meeting invitation.",
    "What is the Pythagorean theorem? Give an example.",
    "Compare SQL and NoSQL databases.",
    "Why is the sky blue?",
    "Write a SQL query that finds the second highest salary in a table named employees.",
    "What were the causes of the First World War?",
    "Suggest a name for a coffee shop that also sells books.",
    "How does a hash table handle collisions?",
)


def continuations(compute: str, kv: str, backend: str, prompts: list[list[int]], max_tokens: int, threads: int,
                  chunk_tokens: int | None = None) -> tuple[list[list[int]], str]:
    """The greedy continuations, and the path that produced them ("<attention impl>, native step on|off")."""
    batched = {} if chunk_tokens is None else {"max_num_batched_tokens": chunk_tokens}
    llm = LLM(dtype=compute, kv_cache_dtype=kv, kv_cache_memory=256 << 20, attention_backend=backend,
              num_threads=threads, **batched)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    runner = llm.engine.runner
    impl = getattr(runner.attn_impl, "inner", runner.attn_impl)  # FP8 calibration wraps the implementation
    path = f"{type(impl).__name__}, native step {'off' if runner.native_step is None else 'on'}"
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)], path


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compute", nargs="+", default=["float32", "bfloat16"], choices=list(REFERENCE_KV))
    parser.add_argument("--kv", nargs="*", default=["int8", "fp8_e4m3"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--attention-backend", default="native", help="the same for both sides")
    parser.add_argument("--chunk-tokens", type=int, nargs="*", default=[],
                        help="also the reference cache prefilled in chunks of this many tokens (the floor)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="compute threads, fixed for every run (no governor)")
    parser.add_argument("--json")
    args = parser.parse_args()
    tok = LLM(dtype="float32", kv_cache_memory=16 << 20).tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    rows = []
    for compute in args.compute:
        reference, reference_path = continuations(compute, REFERENCE_KV[compute], args.attention_backend, prompts,
                                                  args.max_tokens, args.threads)
        sides = [(kv, None) for kv in args.kv] + [(REFERENCE_KV[compute], n) for n in args.chunk_tokens]
        for kv, chunk in sides:
            got, path = continuations(compute, kv, args.attention_backend, prompts, args.max_tokens, args.threads, chunk)
            diffs = [first_difference(a, b) for a, b in zip(reference, got)]
            rows.append({"compute": compute, "kv_cache_dtype": kv, "reference_kv": REFERENCE_KV[compute],
                         "max_num_batched_tokens": chunk, "threads": args.threads,
                         "path": path, "reference_path": reference_path,
                         "prompts": len(prompts), "identical": sum(d is None for d in diffs),
                         "first_difference_at": diffs, "max_tokens": args.max_tokens})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "first_difference_at"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({**host_info(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
