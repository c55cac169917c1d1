"""Each GGUF format's one-row product (GEMV) at a Llama-1B-sized matrix, file layout against rows interleaved in
groups of 16, in one ISA tier: one JSON line per format and kernel, then one summary object.

    PAGEDSERVE_CPU_ISA=avx2 python benchmarks/packed_grouped_formats.py --threads 1 --output results.json

Kernels, on the same random weights (gguf's quantizer for the 32-value formats, random K blocks with finite
scales for the K formats):
  file              the file's layout, fp32 activations (packed_linear.c + packed_f32.c): what quant/gguf.py served
                    a format without a fast interleaved kernel,
  grouped_portable  the interleaved layout's portable C build (the "portable" tier's kernel),
  grouped           the interleaved layout in this tier's build (packed_grouped.c, packed_grouped_wide.c): what
                    quant/gguf.py serves where `grouped_isa(lib, type)` is in FAST_GROUPED_ISAS.
Microseconds per call (best of --repeats), GB/s of the weight bytes read, the tier and CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from contention import cpu_model  # noqa: E402
from gguf_fixtures import random_k_blocks  # noqa: E402
from packed_gemv import best_us  # noqa: E402

from pagedserve.kernels.cpu import isa  # noqa: E402
from pagedserve.kernels.cpu import packed as cpu_packed  # noqa: E402
from pagedserve.kernels.cpu.build import library_tier  # noqa: E402


def blocks(qtype: str, out: int, inn: int, rng: np.random.Generator) -> np.ndarray:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    if qtype.endswith("_K"):
        return random_k_blocks((out, inn), T[qtype], rng, scale=2e-3)
    return quantize(rng.standard_normal((out, inn)).astype(np.float32) * 0.02, T[qtype])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=list(cpu_packed.FORMATS))
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--out-features", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", type=Path, help="also write the summary object here (JSON)")
    parser.add_argument("--conditions", default="", help="recorded as is, e.g. 'noisy: other processes share the cores'")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib, portable = cpu_packed.build(), cpu_packed.build("portable")
    tier = library_tier(lib)
    rng = np.random.default_rng(0)
    x = torch.randn(args.rows, args.in_features)
    lines = []
    for qtype in args.formats:
        stored = torch.from_numpy(blocks(qtype, args.out_features, args.in_features, rng))
        kernels = {"file": cpu_packed.PackedMatrix(qtype, stored, args.in_features, lib=lib),
                   "grouped_portable": cpu_packed.PackedMatrix(qtype, stored.clone(), args.in_features,
                                                               lib=portable).grouped(),
                   "grouped": cpu_packed.PackedMatrix(qtype, stored.clone(), args.in_features, lib=lib).grouped()}
        for kernel, matrix in kernels.items():
            us = best_us(lambda: matrix.matmul(x), args.repeats if kernel != "grouped_portable" else 3)
            line = {"type": qtype, "kernel": kernel, "isa": cpu_packed.grouped_isa(matrix.lib, qtype)
                    if kernel != "file" else cpu_packed.isa(matrix.lib), "in": args.in_features,
                    "out": args.out_features, "rows": args.rows, "us": round(us, 1),
                    "gb_s": round(stored.numel() / us / 1e3, 2), "threads": args.threads}
            lines.append(line)
            print(json.dumps(line), flush=True)
    summary = {"benchmark": "packed_grouped_formats", "cpu": cpu_model(), "tier": tier,
               "host_tier": isa.host_tier(), "forced_by": isa.ENV_VAR, "threads": args.threads,
               "repeats": args.repeats, "conditions": args.conditions, "load_avg_1m": os.getloadavg()[0],
               "results": lines}
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    if args.output:
        args.output.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
