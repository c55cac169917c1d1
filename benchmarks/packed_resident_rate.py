"""The interleaved-rows kernels' instruction-bound rate: one activation row against a slice of a real GGUF matrix
small enough to stay in L2, per build, the builds interleaved: JSON lines.

A one-stream decode step reads its weights from memory (benchmarks/packed_token_sweep.py measures that); here the
slice (--kb, default 900 KiB: inside the 2 MiB L2 of the Sapphire Rapids guest it was written on; on a 512 KiB L2,
Zen 3's, pass --kb 448) is read again and again, so the rate is what the kernel's instructions allow, the ceiling
it brings to the memory-bound step. Each slice is the
first rows of the named tensor (whole groups of 16), rows grouped as the loaders serve them. Per build: the best
over --repeats of the mean call time of --calls calls, on the calling thread's CPU clock (one thread: a shared
host's time slicing does not inflate it), and GB/s of the slice's bytes. Every build's outputs for 1-5 and 9
activation rows are checked equal to the first build's, bit for bit.

    python benchmarks/packed_resident_rate.py --builds avx2 avx2_vnni avx512_vnni
    python benchmarks/packed_resident_rate.py --builds avx2 avx2@/tmp/old-kernels   # an A/B of sources
    python benchmarks/packed_resident_rate.py --tensors FILE.gguf:blk.0.ffn_down.weight ...

A build is what packed_token_sweep.py takes: a tier name of kernels/cpu/isa.py, or TIER@DIR (that tier's flags on
the C files in DIR). Tensors: TENSOR of --gguf, or FILE:TENSOR.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402
from packed_token_sweep import library  # noqa: E402

from pagedserve.kernels.cpu import isa  # noqa: E402
from pagedserve.kernels.cpu import packed as cpu_packed  # noqa: E402

PEERS = Path.home() / ".cache/pagedserve-peers/gguf"
DEFAULT_TENSORS = ("blk.0.ffn_down.weight", "blk.0.ffn_gate.weight", "token_embd.weight",
                   f"{PEERS}/llama-1b-shape-smollm2-vocab-q8_0.gguf:blk.0.ffn_gate.weight")


def load_slice(spec: str, default_gguf: str, kb: int) -> tuple[str, str, int, np.ndarray]:
    """(name, GGUF type, in_features, the first rows' blocks) of FILE:TENSOR or TENSOR."""
    from gguf import GGUFReader

    path, name = spec.rsplit(":", 1) if ":" in spec else (default_gguf, spec)
    tensor = next(t for t in GGUFReader(path).tensors if t.name == name)
    data = np.array(tensor.data)
    rows = max(cpu_packed.GROUP_ROWS, kb * 1024 // data.shape[1] // cpu_packed.GROUP_ROWS * cpu_packed.GROUP_ROWS)
    return f"{Path(path).name}:{name}", tensor.tensor_type.name, int(tensor.shape[0]), data[:rows].copy()


def call_seconds(matrix: cpu_packed.PackedMatrix, x: torch.Tensor, y: torch.Tensor, calls: int) -> float:
    """Mean thread CPU seconds of `calls` one-thread products, straight through ctypes (no tensor per call)."""
    fn, state = matrix.lib.pagedserve_packed_linear_threads, ctypes.byref(matrix.state)
    fn(state, x.data_ptr(), x.shape[0], y.data_ptr(), 1)
    start = time.thread_time()
    for _ in range(calls):
        fn(state, x.data_ptr(), x.shape[0], y.data_ptr(), 1)
    return (time.thread_time() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--builds", nargs="+", default=["avx2", "avx2_vnni", "avx512_vnni"])
    parser.add_argument("--gguf", default=str(PEERS / "llama-1b-shape-smollm2-vocab-q4_k_m.gguf"))
    parser.add_argument("--tensors", nargs="+", default=list(DEFAULT_TENSORS))
    parser.add_argument("--kb", type=int, default=900, help="slice size, KiB")
    parser.add_argument("--rows", type=int, default=1, help="activation rows per call")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--conditions", default="unstated", help="recorded as is: quiet, noisy (what else ran)")
    parser.add_argument("--output", type=Path, help="also append the JSON lines here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    libs = {b: library(b) for b in args.builds}
    cases, lines = [], []
    for spec in args.tensors:
        name, qtype, inn, blocks = load_slice(spec, args.gguf, args.kb)
        x = torch.randn(9, inn, generator=torch.Generator().manual_seed(1)) * torch.rand(9, 1) * 3
        first = None
        for build, lib in libs.items():
            matrix = cpu_packed.PackedMatrix(qtype, torch.from_numpy(blocks.copy()), inn, lib=lib).grouped()
            outs = [matrix.matmul(x[:n].contiguous()) for n in (1, 2, 3, 4, 5, 9)]
            first = first or outs
            cases.append({"tensor": name, "type": qtype, "build": build, "matrix": matrix, "bytes": blocks.nbytes,
                          "x": x[:args.rows].contiguous(), "y": torch.empty(args.rows, blocks.shape[0]),
                          "bit_identical": all(torch.equal(a, b) for a, b in zip(outs, first, strict=True))})
    for repeat in range(args.repeats):
        for case in cases if repeat % 2 == 0 else cases[::-1]:
            seconds = call_seconds(case["matrix"], case["x"], case["y"], args.calls)
            case["best"] = min(case.get("best", seconds), seconds)
    for case in cases:
        lines.append({"tensor": case["tensor"], "type": case["type"], "build": case["build"],
                      "grouped_isa": cpu_packed.grouped_isa(case["matrix"].lib, case["type"]),
                      "kib": case["bytes"] // 1024, "rows": args.rows, "us": round(case["best"] * 1e6, 1),
                      "gb_s": round(case["bytes"] / case["best"] / 1e9, 2),
                      "bit_identical_to_first_build": case["bit_identical"]})
    lines.append({"benchmark": "packed_resident_rate", "cpu": cpu_model(), "host_tier": isa.host_tier(),
                  "threads": 1, "clock": "thread", "repeats": args.repeats, "calls": args.calls,
                  "conditions": args.conditions, "load_avg_1m": os.getloadavg()[0],
                  "date": time.strftime("%Y-%m-%d %H:%M")})
    with (args.output.open("a") if args.output else open(os.devnull, "w")) as sink:
        for line in lines:
            print(json.dumps(line), flush=True)
            sink.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
