"""What quant/gguf_prefill.py's host rule decides here, and the per-call timings behind it, on random Q4_K matrices
of a 1B Llama's shapes (no GGUF file needed): the packed kernel, the per-call scratch in the grouped layout through
kernels/cpu/dense_gemm.c, and the row-major scratch through torch's GEMM; best of `--repeats`, taking turns. One
JSON line per (matrix, rows), then the rule `measured_rule` returns in this process.

    python benchmarks/gguf_expansion_rule.py --rows 64 128 256
    python benchmarks/gguf_expansion_rule.py --no-amx   # a host whose VM refuses AMX tiles, on one that grants them

--no-amx denies AMX to both GEMMs: oneDNN through ONEDNN_MAX_CPU_ISA (set before torch loads) and dense_gemm.c
through its allow_amx argument; the rule then takes the no-AMX branch it takes on such a host.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from pathlib import Path

SHAPES = {"q": (2048, 2048), "k": (512, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}  # out x in


def best_of(repeats: int, calls: dict) -> dict[str, float]:
    times = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name] = min(times[name], time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matrices", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--no-amx", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--conditions", default="noisy: other processes share the 2 cores")
    args = parser.parse_args()
    if args.no_amx:
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from contention import cpu_model

    from pagedserve.engine.host.allocator import keep_freed_memory
    from pagedserve.kernels.cpu import packed as cpu_packed
    from pagedserve.quant import dense_native, gguf_prefill

    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as a CPU engine does: the per-call scratch reused from the heap, not page-faulted afresh
    if args.no_amx:
        dense_native.dense_gemm = functools.partial(dense_native.dense_gemm, allow_amx=False)
        gguf_prefill._amx_granted = lambda: False
        gguf_prefill._grouped_gemm_in_bf16 = lambda: dense_native.gemm_isa(allow_amx=False) == "avx512_bf16"
    lib = cpu_packed.build()
    if not cpu_packed.grouped_bf16_available(lib):
        sys.exit(f"the {cpu_packed.isa(lib)} build has no per-call bf16 expansion: quant/gguf_prefill.py serves none here")
    head = {"cpu": cpu_model(), "tier": cpu_packed.isa(lib), "gemm_isa": dense_native.gemm_isa(
        allow_amx=not args.no_amx), "no_amx": args.no_amx, "threads": args.threads, "conditions": args.conditions}
    print(json.dumps(head), flush=True)
    _, per, size = cpu_packed.FORMATS["Q4_K"]
    for name in args.matrices:
        out, inn = SHAPES[name]
        blocks = torch.randint(0x20, 0x40, (out, inn // per * size), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(0))  # every scale a normal positive fp16
        matrix = cpu_packed.PackedMatrix("Q4_K", blocks, inn, lib=lib).grouped()
        for rows in args.rows:
            x = torch.randn(rows, inn, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            times = best_of(args.repeats, {
                "packed": lambda: matrix.matmul(x.float()),
                "grouped": lambda: gguf_prefill.dequantized_linear(matrix, x, grouped=True),
                "row_major": lambda: gguf_prefill.dequantized_linear(matrix, x, grouped=False)})
            print(json.dumps({"matrix": name, "out": out, "in": inn, "rows": rows,
                              **{f"{k}_ms": round(v * 1e3, 3) for k, v in times.items()},
                              "grouped_x": round(times["packed"] / times["grouped"], 2),
                              "row_major_x": round(times["packed"] / times["row_major"], 2)}), flush=True)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    print(json.dumps({"rule": repr(gguf_prefill.host_rule(lib))}), flush=True)


if __name__ == "__main__":
    main()
