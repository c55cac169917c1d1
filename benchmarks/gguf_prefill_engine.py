"""Whole-engine prefill of a GGUF file under `--gguf-weights auto`, one mode per fresh process: prompt tokens/s of
512- and 2048-token prompts (max_tokens=1, best of 2) and the resident set after load and at the end. One JSON line
per mode and round; rounds interleave the modes so a noisy host's drift hits them alike.

    python benchmarks/gguf_prefill_engine.py --model FILE.gguf --rounds 2 --output results.jsonl

Modes: `auto` (what serves now: packed kernels, per-call bf16 expansion where quant/gguf_prefill.py's host rule
says: from 64 rows with AMX; without, from 256 rows for the K formats and, for Q4_K/Q5_K, from 64 through the
grouped GEMM or from 128 through the row-major scratch, where this host timed each faster), `auto-k-from-256`
(without AMX, the K formats from 256 rows only), `auto-row-major-early` (Q4_K/Q5_K's earlier start through the
row-major scratch only), `auto-amx-row-major` (with AMX, every
expanded call through the row-major scratch and torch's GEMM), `auto-packed-only` (the expansion switched off: the packed kernels at every row count) and
`auto-dense-copy` (each layer also holding its weights expanded at load in the compute dtype for prefill: what
`auto` did on the AVX-512 tiers before, quant/gguf.py's many-row rule and the expansion switched off).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

MODES = ("auto", "auto-packed-only", "auto-dense-copy", "auto-k-from-256", "auto-row-major-early", "auto-amx-row-major")


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(model: str, mode: str, lengths: list[int]) -> dict:
    import torch

    from pagedserve.quant import gguf as gguf_method
    from pagedserve.quant import gguf_prefill

    if mode == "auto-dense-copy":
        gguf_method.MANY_ROW_GROUPED_ISAS = ("avx2_vnni", "avx2")
        gguf_prefill.MIN_ROWS = 1 << 62
    elif mode == "auto-packed-only":
        gguf_prefill.host_rule = lambda lib: None
    elif mode == "auto-k-from-256":
        gguf_prefill.EARLY_TYPES = frozenset()
    elif mode == "auto-row-major-early":
        gguf_prefill._grouped_gemm_in_bf16 = lambda: False
    elif mode == "auto-amx-row-major":
        gguf_prefill.AMX_GROUPED_ROWS = 0
    from pagedserve.engine import SamplingParams
    from pagedserve.engine.llm import LLM

    llm = LLM(model, gguf_weights="auto", kv_cache_memory=256 << 20)
    result = {"mode": mode, "rss_loaded": _rss()}
    gen = torch.Generator().manual_seed(0)
    once = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([torch.randint(100, 40000, (64,), generator=gen).tolist()], once)
    for n in lengths:
        best = float("inf")
        for _ in range(2):
            ids = torch.randint(100, 40000, (n,), generator=gen).tolist()
            start = time.perf_counter()
            llm.generate([ids], once)
            best = min(best, time.perf_counter() - start)
        result[f"prefill_{n}_tok_s"] = round(n / best, 1)
    result["rss_after"] = _rss()
    result["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--modes", nargs="+", default=["auto", "auto-dense-copy"], choices=MODES)
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--conditions", default="noisy: other processes share the cores")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child, args.lengths)), flush=True)
        return
    lines = []
    for _ in range(args.rounds):
        for mode in args.modes:
            out = subprocess.run([sys.executable, "-P", __file__, "--model", args.model, "--child", mode,
                                  "--lengths", *map(str, args.lengths)], check=True, capture_output=True, text=True,
                                 env=os.environ)
            line = {**json.loads(out.stdout.strip().splitlines()[-1]), "conditions": args.conditions,
                    "load_avg_1m": os.getloadavg()[0]}
            lines.append(line)
            print(json.dumps(line), flush=True)
    if args.output:
        args.output.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
