"""FP8 KV-cache accuracy on the default model (SmolLM2-135M-Instruct): perplexity, greedy agreement, capacity.

1. Perplexity on real English text (the Python reference manual that ships with CPython as pydoc_data.topics,
   so it is available offline) with the KV cache in fp32 / fp16 / fp8_e4m3 / fp8_e5m2. Each window of
   --window tokens is one prefill whose attention reads K/V back from the (quantized) cache, exactly as decode
   steps do, so every position's logits see fp8 K/V. FP8 scales are calibrated the way the engine does it:
   on the first prefill it serves (here a 44-token chat prompt, the realistic worst case), with K rotated by a
   Hadamard matrix (the engine's default); for e4m3 also without the rotation, and with neither (scales 1.0).
2. Greedy agreement with the fp16-KV run over a prompt set (chat template, --max-tokens new tokens each):
   teacher-forced (does this cache dtype pick the same next token as fp16 did, given fp16's history: the
   per-token agreement), and free-running (position-wise share of identical tokens; one early flip makes the
   rest of a sequence differ, so this compounds the per-token rate over the sequence length).
3. The most concurrent 2k-token sequences a fixed KV budget holds, from the engine's own block count.

    python benchmarks/fp8_kv_accuracy.py --json fp8.json     # ~10 min on 2 busy cores
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import torch

from pagedserve.engine import LLM, LLMEngine, EngineConfig, SamplingParams
from pagedserve.engine.models.layers import ForwardContext
from pagedserve.kernels.kv_scales import CalibratingAttention
from pagedserve.kernels.attention import AttentionMetadata

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
    "Give me three tips for learning a new language.", "What is 17 times 23?", "Describe a cat in one sentence.",
    "Why is the sky blue?", "Write a short story opening about a lighthouse keeper.", "What does a CPU do?",
    "List the planets of the solar system.", "How do I boil an egg?", "Translate 'good morning' into Spanish.",
    "What is the difference between weather and climate?", "Suggest a name for a bakery.",
    "Summarize the plot of Romeo and Juliet.", "What are prime numbers?", "How does a bicycle stay upright?",
    "Write a polite email declining a meeting.", "What is machine learning?", "Give an example of a metaphor.",
]
CALIBRATION_CHAT = "Hi! Can you help me write a short note to my neighbour?"
KV_DTYPES = ("fp32", "fp16", "fp8_e4m3", "fp8_e5m2")


def english_text() -> str:
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))


def forward_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """One sequence prefilled from position 0 into blocks 0.. of the engine's cache -> logits [T, vocab]."""
    runner = engine.runner
    n, block_size = len(ids), runner.kv_spec.block_size
    blocks = torch.arange(-(-n // block_size), dtype=torch.int32).view(1, -1)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=blocks, slot_mapping=torch.arange(n), max_query_len=n, max_seq_len=n,
        query_lens_host=(n,), seq_lens_host=(n,),
    )
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids), torch.arange(n), ForwardContext(meta, runner.kv_cache, runner.attn_impl))
        return runner.model.compute_logits(hidden)


def perplexity(engine: LLMEngine, windows: list[list[int]], calibration: list[int] | None) -> float:
    if calibration is not None:
        forward_logits(engine, calibration)
    nll, count = 0.0, 0
    for ids in windows:
        logits = forward_logits(engine, ids)
        nll += torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    return math.exp(nll / count)


def make_engine(kv_dtype: str, memory: int) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_dtype=kv_dtype, kv_cache_memory=memory, attention_backend="torch"))


def perplexity_rows(args) -> list[dict]:
    probe = make_engine("fp32", 64 << 20)
    ids = probe.tokenizer.encode(english_text(), add_special_tokens=False)
    windows = [ids[i * args.window : (i + 1) * args.window] for i in range(args.windows)]
    chat = probe.tokenizer.apply_chat_template([{"role": "user", "content": CALIBRATION_CHAT}])
    variants = [
        ("fp32", "-"), ("fp16", "-"),
        ("fp8_e4m3", "calibrated + K rotation (default)"), ("fp8_e5m2", "calibrated + K rotation (default)"),
        ("fp8_e4m3", "calibrated, no rotation"), ("fp8_e4m3", "scales 1.0, no rotation"),
    ]
    rows = []
    for kv_dtype, setup in variants:
        engine = make_engine(kv_dtype, 64 << 20)
        if "no rotation" in setup:
            engine.runner.kv_cache.set_k_rotation(None)
        if setup.startswith("scales 1.0"):
            engine.runner.attn_impl = engine.runner.attn_impl.inner  # skip calibration: scales stay 1.0
        t0 = time.perf_counter()
        ppl = perplexity(engine, windows, chat if setup.startswith("calibrated") else None)
        rows.append({"kv_cache_dtype": kv_dtype, "setup": setup, "perplexity": ppl,
                     "tokens": sum(len(w) - 1 for w in windows), "seconds": time.perf_counter() - t0})
        print(f"ppl {kv_dtype:9} {setup:34} {ppl:.4f}", flush=True)
    base = next(r["perplexity"] for r in rows if r["kv_cache_dtype"] == "fp16")
    for row in rows:
        row["vs_fp16_pct"] = 100.0 * (row["perplexity"] / base - 1.0)
    return rows


def forced_agreement(engine: LLMEngine, prompts: list[list[int]], references: list[tuple[int, ...]]) -> float:
    """Share of positions where this engine's argmax equals the reference's greedy token, given the reference's
    own history (teacher forcing): one flip does not drag every later position along."""
    same = total = 0
    for prompt, ref in zip(prompts, references):
        logits = forward_logits(engine, prompt + list(ref[:-1]))
        same += int((logits[len(prompt) - 1 :].argmax(-1) == torch.tensor(ref)).sum())
        total += len(ref)
    return 100.0 * same / total


def agreement_rows(args) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs, engines = {}, {}
    for kv_dtype in KV_DTYPES:
        llm = LLM(kv_cache_dtype=kv_dtype, attention_backend="torch", kv_cache_memory=64 << 20)
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        outputs[kv_dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        engines[kv_dtype] = llm.engine
        print(f"generated with {kv_dtype}", flush=True)
    rows = []
    reference = outputs["fp16"]
    total = sum(len(ref) for ref in reference)
    for kv_dtype, outs in outputs.items():
        same = sum(a == b for ref, out in zip(reference, outs) for a, b in zip(ref, out))
        prefix = sum(next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), len(ref)) for ref, out in zip(reference, outs))
        rows.append({"kv_cache_dtype": kv_dtype, "teacher_forced_pct": forced_agreement(engines[kv_dtype], prompts, reference),
                     "free_running_positionwise_pct": 100.0 * same / total,
                     "free_running_before_first_divergence_pct": 100.0 * prefix / total,
                     "identical_sequences": sum(r == o for r, o in zip(reference, outs)), "sequences": len(reference)})
    return rows


def capacity_rows(memory: int, seq_len: int = 2048) -> list[dict]:
    rows = []
    for kv_dtype in ("fp32", "fp16", "fp8_e4m3"):
        engine = make_engine(kv_dtype, memory)
        stats = engine.stats()
        per_seq = -(-seq_len // stats.block_size)
        rows.append({"kv_cache_dtype": kv_dtype, "kv_cache_memory": memory, "blocks": stats.num_kv_blocks,
                     "tokens": stats.num_kv_blocks * stats.block_size, "concurrent_2k_sequences": stats.num_kv_blocks // per_seq})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--capacity-memory", type=int, default=1 << 30)
    parser.add_argument("--skip", nargs="*", default=(), choices=["perplexity", "agreement", "capacity"])
    parser.add_argument("--json")
    args = parser.parse_args()
    result = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if "capacity" not in args.skip:
        result["capacity"] = capacity_rows(args.capacity_memory)
        print(json.dumps(result["capacity"], indent=1), flush=True)
    if "perplexity" not in args.skip:
        result["perplexity"] = perplexity_rows(args)
    if "agreement" not in args.skip:
        result["agreement"] = agreement_rows(args)
        print(json.dumps(result["agreement"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
