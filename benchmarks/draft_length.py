"""Which draft length pays: speculation settings replayed over fixed greedy outputs (never in CI).

    python benchmarks/draft_length.py > benchmarks/results/<date>-draft-length.json
    python benchmarks/draft_length.py --outputs /tmp/outputs.json   # keep the generated outputs for a rerun

Greedy speculation never changes the tokens, so whether a draft is accepted depends only on the output decoding
without drafts: a draft stands while it equals the output's next tokens. This script decodes each prompt once
without speculation (one stream, the default model), then replays the engine's own drafter (`Drafter.propose` and
`Drafter.observe`: lookup, draft length, back-off) over the output, step by step, for each setting. Nothing is
timed: a step with d drafts is costed 1 + alpha * d one-row steps, for each `--alpha` (a draft row's cost over a
one-row step; ~0.2 on the native CPU step with the copy workload's 400-600-token contexts, from the quiet
1-stream run in docs/speculative-decoding.md), and the figure is the ITL ratio that cost model gives.

Texts: copy edits (replace one word of a committed text, benchmarks/fp8_texts) and free writing; the settings are
chosen on the "choose" texts and confirmed on the others ("confirm"). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from pagedserve.engine import LLM, SamplingParams  # noqa: E402
from pagedserve.engine.core.sequence import Sequence, SequenceMetrics  # noqa: E402
from pagedserve.engine.spec_decode.config import SpeculativeConfig  # noqa: E402
from pagedserve.engine.spec_decode.drafter import Drafter  # noqa: E402

TEXTS = Path(__file__).resolve().parent / "fp8_texts"
ASK = 'Rewrite the following text, replacing the word "{a}" with "{b}" everywhere. Change nothing else.\n\n{text}'
# (file, word, replacement, chunks); spec_decode.py's copy workload is python-license.txt chunk 0
COPY = [("python-license.txt", "Python", "PYTHON", 10), ("gpl-3.txt", "License", "LICENSE", 4),
        ("zlib-faq-chat.txt", "zlib", "ZLIB", 3), ("argparse.txt", "self", "this", 3),
        ("zlib-h.txt", "stream", "strm", 3), ("torch-derivatives-yaml.txt", "self", "input", 3),
        ("vim-tutor-fr.txt", "Vim", "VIM", 2), ("procps-faq-chat.txt", "ps", "PS", 2)]
FREE = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how photosynthesis works to a ten-year-old.", "Write a poem about autumn in a big city.",
        "Write an email to a colleague asking to move our meeting to Thursday.",
        "Give me ten tips for learning a new language.", "Describe the history of the bicycle.",
        "What are the pros and cons of working from home?", "Write a recipe for a vegetable soup."]
CHOOSE = {"python-license.txt:0", "python-license.txt:2", "python-license.txt:3", "python-license.txt:4",
          "gpl-3.txt:0", "gpl-3.txt:1", "argparse.txt:0", "zlib-h.txt:0", "torch-derivatives-yaml.txt:0",
          "free:0", "free:1", "free:2", "free:3"}
SETTINGS = {
    "k4 lookup 2-4": SpeculativeConfig(4, prompt_lookup_min=2, prompt_lookup_max=4, adaptive_drafts=False),
    "k4 lookup 2-4 adaptive": SpeculativeConfig(4, prompt_lookup_min=2, prompt_lookup_max=4),
    "k8 lookup 2-16": SpeculativeConfig(8, prompt_lookup_min=2, prompt_lookup_max=16, adaptive_drafts=False),
    "k8 lookup 2-16 adaptive": SpeculativeConfig(8, prompt_lookup_min=2, prompt_lookup_max=16),
    "k16 lookup 2-16 adaptive": SpeculativeConfig(16, prompt_lookup_min=2, prompt_lookup_max=16),
    "k5 lookup 5-5 (vLLM's default lookup)": SpeculativeConfig(5, adaptive_drafts=False),
    "k5 lookup 5-5 adaptive": SpeculativeConfig(5),
}


def chunks(llm: LLM, path: Path, count: int, lo: int = 300, hi: int = 1000) -> list[str]:
    """spec_decode.py's license_chunks for any text: consecutive paragraph runs of lo-hi tokens."""
    out, current = [], []
    for para in (p.strip() for p in path.read_text().split("\n\n") if p.strip()):
        current.append(para)
        size = len(llm.tokenizer.encode("\n\n".join(current)))
        if size >= lo:
            text = "\n\n".join(current)
            out.append(llm.tokenizer.decode(llm.tokenizer.encode(text)[:hi]) if size > hi else text)
            current = []
            if len(out) == count:
                break
    return out


def texts(llm: LLM) -> list[dict]:
    chat = llm.tokenizer.apply_chat_template
    items = [{"name": f"{name}:{i}", "kind": "copy",
              "prompt": chat([{"role": "user", "content": ASK.format(a=a, b=b, text=text)}])}
             for name, a, b, count in COPY for i, text in enumerate(chunks(llm, TEXTS / name, count))]
    return items + [{"name": f"free:{i}", "kind": "free", "prompt": chat([{"role": "user", "content": ask}])}
                    for i, ask in enumerate(FREE)]


def replay(config: SpeculativeConfig, prompt: list[int], output: list[int], max_tokens: int, alpha: float) -> dict:
    """The drafter over one output: decode steps, their cost in one-row steps, drafts and accepted drafts."""
    drafter = Drafter(config, max_model_len=1 << 20)
    seq = Sequence("r", 0, [*prompt, output[0]], len(prompt), SamplingParams(temperature=0, max_tokens=max_tokens),
                   SequenceMetrics(arrival_time=0.0))
    done, cost, steps, drafts, accepted = 1, 0.0, 0, 0, 0
    while done < len(output):
        seq.num_computed_tokens = seq.num_tokens - 1
        proposed = drafter.propose(seq, budget=1 << 20)
        taken = 0
        while taken < len(proposed) and done + taken < len(output) and proposed[taken] == output[done + taken]:
            taken += 1
        new = min(taken + 1, len(output) - done)
        seq.token_ids += output[done : done + new]
        done, steps, cost = done + new, steps + 1, cost + 1 + alpha * len(proposed)
        if proposed:
            Drafter.observe(seq, taken)
            drafts, accepted = drafts + len(proposed), accepted + taken
    return {"ratio": round((len(output) - 1) / cost, 3), "steps": steps, "drafts": drafts, "accepted": accepted}


def summary(results: dict[str, dict], names: list[str], kind: str) -> dict:
    ratios = {n: results[n]["ratio"] for n in names if n.startswith("free:") == (kind == "free")}
    worst = min(ratios, key=ratios.get)
    return {"mean": round(statistics.mean(ratios.values()), 3), "worst": ratios[worst], "worst_text": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.15, 0.2, 0.3])
    parser.add_argument("--outputs", type=Path, default=None, help="read the outputs from here, or write them here")
    args = parser.parse_args()
    if args.outputs and args.outputs.exists():
        items = json.loads(args.outputs.read_text())
    else:
        llm = LLM(None)
        items = texts(llm)
        for item in items:
            out = llm.generate([item["prompt"]], SamplingParams(temperature=0, max_tokens=args.max_tokens))[0]
            item["output"] = list(out.outputs[0].token_ids)
        if args.outputs:
            args.outputs.write_text(json.dumps(items))
    result: dict = {"benchmark": "draft_length", "max_tokens": args.max_tokens, "choose": sorted(CHOOSE),
                    "settings": {}}
    for label, config in SETTINGS.items():
        per_alpha = {}
        for alpha in args.alpha:
            runs = {it["name"]: replay(config, it["prompt"], it["output"][: args.max_tokens], args.max_tokens, alpha)
                    for it in items}
            split = {"choose": [n for n in runs if n in CHOOSE], "confirm": [n for n in runs if n not in CHOOSE]}
            per_alpha[str(alpha)] = {f"{part}_{kind}": summary(runs, names, kind)
                                     for part, names in split.items() for kind in ("copy", "free")}
            per_alpha[str(alpha)]["per_text"] = runs
        result["settings"][label] = per_alpha
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
