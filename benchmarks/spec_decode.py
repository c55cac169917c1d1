"""Does n-gram speculative decoding pay on this CPU? (Never in CI.)

    python benchmarks/spec_decode.py                       # default model, k=8, lookup 2-16, adaptive drafts
    python benchmarks/spec_decode.py --k 4 --lookup-max 4 --no-adaptive-drafts   # the earlier setting
    python benchmarks/spec_decode.py --concurrency 1 --no-saturation \\
        --also-spec '{"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4, "adaptive_drafts": false}'
    python benchmarks/spec_decode.py --quick               # a smoke run: shorter outputs, one repeat, no saturation
    python benchmarks/spec_decode.py --concurrency 1 2 4 8 16 --disable-by-batch-size 64 --no-saturation  # crossover

Three figures, printed as one JSON object with the machine (CPU model, usable cores, load average before/after):
- copy: an edit of a given text (chunks of Python's LICENSE.txt, 300-1,000 tokens each; the copy committed as
  benchmarks/fp8_texts/python-license.txt, so every machine edits the same text) at concurrency 1 and 4, greedy: the mean inter-token latency per request (time from its first to its last
  token over the tokens between) without and with speculation, the ratio (target >= 1.8) and the acceptance counts.
  Greedy outputs are token-identical with and without drafts, so both runs do exactly the same tokens.
- free_writing: one stream writing a story (nothing to copy), greedy: the same ITL ratio where drafts are rare and
  mostly wrong (what speculation costs a workload it does not suit).
- saturation: the standard workload (benchmarks/workload.py defaults: 64 requests of random token ids, all at once),
  output tokens per second without and with speculation (auto-off above `disable_by_batch_size`); target >= 0.97.
Runs alternate (A/B) on two engines loaded side by side (three with --also-spec); medians reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from contention import cpu_model  # noqa: E402
from pagedserve.engine import LLM, SamplingParams  # noqa: E402
from pagedserve.engine.spec_decode.config import SpeculativeConfig  # noqa: E402
from workload import WorkloadConfig, build_workload  # noqa: E402

LICENSE = Path(__file__).resolve().parent / "fp8_texts" / "python-license.txt"
ASK = ("Rewrite the following text, replacing the word \"Python\" with \"PYTHON\" everywhere. Change nothing "
       "else.\n\n{text}")


def license_chunks(llm: LLM, count: int, lo: int = 300, hi: int = 1000) -> list[str]:
    """Consecutive paragraph runs of Python's LICENSE.txt, each between lo and hi tokens (the text has about ten;
    more than that repeats them, each with its own number in front so no two prompts are equal)."""
    paragraphs = [p.strip() for p in LICENSE.read_text().split("\n\n") if p.strip()]
    chunks, current = [], []
    for para in paragraphs:
        current.append(para)
        size = len(llm.tokenizer.encode("\n\n".join(current)))
        if size >= lo:
            text = "\n\n".join(current)
            if size > hi:
                text = llm.tokenizer.decode(llm.tokenizer.encode(text)[:hi])
            chunks.append(text)
            current = []
    assert chunks, f"{LICENSE} has no run of paragraphs of >= {lo} tokens"
    if count <= len(chunks):
        return chunks[:count]
    return [f"({i + 1})\n{chunks[i % len(chunks)]}" for i in range(count)]


def edit_prompt(llm: LLM, text: str) -> list[int]:
    """The instruction as a chat turn (the default model is an instruct model), as token ids."""
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": ASK.format(text=text)}])


def run_timed(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[list[float], int]:
    """Mean inter-token latency of each request (s), and the output tokens of all."""
    engine = llm.engine
    first, last, counts = {}, {}, {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"b{i}", prompt, p)
    while engine.has_unfinished_requests():
        outs = engine.step()
        t = time.perf_counter()
        for out in outs:
            if out.outputs[0].new_token_ids:
                first.setdefault(out.request_id, t)
                last[out.request_id] = t
                counts[out.request_id] = out.outputs[0].num_tokens
    itl = [(last[r] - first[r]) / (counts[r] - 1) for r in first if counts[r] > 1]
    return itl, sum(counts.values())


def spec_counts(llm: LLM) -> dict:
    s = llm.engine.stats()
    return {"drafts": s.spec_decode_num_drafts, "draft_tokens": s.spec_decode_num_draft_tokens,
            "accepted": s.spec_decode_num_accepted_tokens,
            "accepted_per_position": list(s.spec_decode_accepted_per_position)}


def copy_figures(engines: dict[str, LLM], concurrency: int, max_tokens: int, repeats: int) -> dict:
    base, spec = engines["base"], engines["spec"]
    prompts = [edit_prompt(base, t) for t in license_chunks(base, concurrency)]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens)] * concurrency
    runs: dict[str, list[float]] = {name: [] for name in engines}
    tokens = {}
    before = {name: spec_counts(llm) for name, llm in engines.items() if name != "base"}
    for _ in range(repeats):
        for name, llm in engines.items():
            itl, tokens[name] = run_timed(llm, prompts, params)
            runs[name].append(statistics.mean(itl))
    b, s = statistics.median(runs["base"]), statistics.median(runs["spec"])
    out = {"concurrency": concurrency, "prompt_tokens": [len(p) for p in prompts],
           "output_tokens": tokens, "itl_ms_base": round(b * 1e3, 2), "itl_ms_spec": round(s * 1e3, 2),
           "itl_ratio": round(b / s, 3), "runs_ms": {k: [round(v * 1e3, 2) for v in vs] for k, vs in runs.items()},
           "acceptance": _difference(spec_counts(spec), before["spec"])}
    return out | _second(engines, runs, before)


def _second(engines: dict[str, LLM], runs: dict[str, list[float]], before: dict) -> dict:
    """The figures of the second speculating engine (--also-spec), when there is one."""
    if "spec_b" not in engines:
        return {}
    b, s = statistics.median(runs["base"]), statistics.median(runs["spec_b"])
    return {"itl_ms_spec_b": round(s * 1e3, 2), "itl_ratio_b": round(b / s, 3),
            "acceptance_b": _difference(spec_counts(engines["spec_b"]), before["spec_b"])}


def _difference(after: dict, before: dict) -> dict:
    out = {}
    for key, value in after.items():
        if isinstance(value, list):
            old = before[key] + [0] * (len(value) - len(before[key]))
            out[key] = [a - b for a, b in zip(value, old)]
        else:
            out[key] = value - before[key]
    return out


FREE_ASK = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def free_figures(engines: dict[str, LLM], max_tokens: int, repeats: int) -> dict:
    """One stream writing new text (no source to copy): what speculation costs when its drafts are mostly wrong."""
    base, spec = engines["base"], engines["spec"]
    prompt = base.tokenizer.apply_chat_template([{"role": "user", "content": FREE_ASK}])
    params = [SamplingParams(temperature=0, max_tokens=max_tokens)]
    runs: dict[str, list[float]] = {name: [] for name in engines}
    before = {name: spec_counts(llm) for name, llm in engines.items() if name != "base"}
    for _ in range(repeats):
        for name, llm in engines.items():
            itl, _ = run_timed(llm, [prompt], params)
            runs[name].append(itl[0])
    b, s = statistics.median(runs["base"]), statistics.median(runs["spec"])
    return {"itl_ms_base": round(b * 1e3, 2), "itl_ms_spec": round(s * 1e3, 2), "itl_ratio": round(b / s, 3),
            "acceptance": _difference(spec_counts(spec), before["spec"])} | _second(engines, runs, before)


def saturation_figures(base: LLM, spec: LLM, repeats: int) -> dict:
    work = build_workload(WorkloadConfig())
    prompts = [list(r.prompt_token_ids) for r in work.requests]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in work.requests]
    runs: dict[str, list[float]] = {"base": [], "spec": []}
    for _ in range(repeats):
        for name, llm in (("base", base), ("spec", spec)):
            start = time.perf_counter()
            _, tokens = run_timed(llm, prompts, params)
            runs[name].append(tokens / (time.perf_counter() - start))
    b, s = statistics.median(runs["base"]), statistics.median(runs["spec"])
    return {"requests": len(prompts), "output_tokens": work.num_output_tokens, "tok_s_base": round(b, 1),
            "tok_s_spec": round(s, 1), "throughput_ratio": round(s / b, 3),
            "runs_tok_s": {k: [round(v, 1) for v in vs] for k, vs in runs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct Q4_1 GGUF")
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=16)
    parser.add_argument("--no-adaptive-drafts", action="store_true", help="always k drafts (adaptive_drafts false)")
    parser.add_argument("--also-spec", default=None, metavar="JSON",
                        help="a second speculating engine with this --speculative-config, run interleaved with the "
                             "others (an A/B of two settings in one run); its figures are the *_b keys")
    parser.add_argument("--disable-by-batch-size", type=int, default=None, help="default: SpeculativeConfig's")
    parser.add_argument("--native-step-max-rows", type=int, default=None,
                        help="the speculating engine's EngineConfig.native_step_max_rows (default: its default)")
    parser.add_argument("--native-step-max-batch", type=int, default=None,
                        help="both engines' EngineConfig.native_step_max_batch (default: its default)")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4],
                        help="copy workload concurrencies (with a large --disable-by-batch-size: the crossover)")
    parser.add_argument("--no-saturation", action="store_true", help="skip the 64-stream saturation figure")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    extra = {} if args.disable_by_batch_size is None else {"disable_by_batch_size": args.disable_by_batch_size}
    config = SpeculativeConfig(args.k, prompt_lookup_min=args.lookup_min, prompt_lookup_max=args.lookup_max,
                               adaptive_drafts=not args.no_adaptive_drafts, **extra)
    common = {"num_threads": args.threads} if args.threads else {}
    if args.native_step_max_batch is not None:
        common["native_step_max_batch"] = args.native_step_max_batch
    load_before = os.getloadavg()
    base = LLM(args.model, **common)
    rows = {} if args.native_step_max_rows is None else {"native_step_max_rows": args.native_step_max_rows}
    spec = LLM(args.model, speculative=config, **common, **rows)
    engines = {"base": base, "spec": spec}
    if args.also_spec:
        also = SpeculativeConfig.from_json(args.also_spec)
        engines["spec_b"] = LLM(args.model, speculative=also, **common, **rows)
    max_tokens, repeats = (48, 1) if args.quick else (args.max_tokens, args.repeats)
    result = {
        "benchmark": "spec_decode", "cpu": cpu_model(), "usable_cores": len(os.sched_getaffinity(0)),
        "speculative_config": {"num_speculative_tokens": config.num_speculative_tokens,
                               "prompt_lookup_min": config.prompt_lookup_min,
                               "prompt_lookup_max": config.prompt_lookup_max,
                               "adaptive_drafts": config.adaptive_drafts,
                               "disable_by_batch_size": spec.engine.scheduler.drafter.disable_by_batch_size},
        "native_step_max_rows": spec.engine.config.native_step_max_rows,
        "native_step_max_batch": spec.engine.config.native_step_max_batch,
        "max_tokens": max_tokens, "repeats": repeats,
        "also_spec": args.also_spec,
        "copy": [copy_figures(engines, c, max_tokens, repeats) for c in args.concurrency],
        "free_writing": free_figures(engines, max_tokens, repeats),
    }
    if not (args.quick or args.no_saturation):
        result["saturation"] = saturation_figures(base, spec, repeats)
    result["loadavg_before"], result["loadavg_after"] = load_before, os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
