"""One stream end to end on the default Q4_1 file, the GGUF blocks in the file's layout (A) against rows interleaved
in groups of 16 (B, what quant/gguf.py serves where the build has a grouped kernel), in the ISA tier this process
builds for (PAGEDSERVE_CPU_ISA, e.g. avx2 on any AVX2 host): one JSON line per repeat pair and a summary line.

    PAGEDSERVE_CPU_ISA=avx2 python benchmarks/grouped_layout_ab.py --repeats 3 --tokens 256

A and B are two engines in this process, the same build, their calls alternated: noise on a shared machine hits
both alike. Output tokens per second of one request (greedy, EOS ignored), best of --repeats.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402

from pagedserve.engine import SamplingParams  # noqa: E402
from pagedserve.engine.llm import LLM  # noqa: E402
from pagedserve.kernels.cpu import packed as cpu_packed  # noqa: E402
from pagedserve.kernels.cpu.build import library_tier  # noqa: E402
from pagedserve.quant import gguf as gguf_method  # noqa: E402


def engine(grouped: bool) -> LLM:
    """The default model with its grouped kernel allowed (B) or not (A: what a build without one serves)."""
    saved = gguf_method.FAST_GROUPED_ISAS
    gguf_method.FAST_GROUPED_ISAS = saved if grouped else ()
    try:
        return LLM(gguf_weights="packed")
    finally:
        gguf_method.FAST_GROUPED_ISAS = saved


def tok_s(llm: LLM, params: SamplingParams) -> float:
    start = time.perf_counter()
    out = llm.generate(["The history of the printing press"], params)
    return len(out[0].outputs[0].token_ids) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--label", default="noisy", help="quiet or noisy: whether other work shared the cores")
    args = parser.parse_args()
    lib = cpu_packed.build()
    meta = {"tier": library_tier(lib), "grouped_isa": cpu_packed.grouped_isa(lib), "cpu": cpu_model(),
            "threads": torch.get_num_threads(), "label": args.label, "tokens": args.tokens}
    engines = {"file": engine(False), "grouped": engine(True)}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    best = {name: 0.0 for name in engines}
    for _ in range(args.repeats):
        pair = {name: tok_s(llm, params) for name, llm in engines.items()}
        best = {name: max(best[name], pair[name]) for name in best}
        print(json.dumps({"kind": "pair", **{f"{k}_tok_s": round(v, 2) for k, v in pair.items()}, **meta}), flush=True)
    print(json.dumps({"kind": "best", **{f"{k}_tok_s": round(v, 2) for k, v in best.items()},
                      "grouped_over_file": round(best["grouped"] / best["file"], 3), **meta}), flush=True)


if __name__ == "__main__":
    main()
