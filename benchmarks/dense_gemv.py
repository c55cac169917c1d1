"""The dense bf16 GEMV of the native step at SmolLM2-135M's shapes, row-major vs rows grouped: JSON lines.

Kernels (kernels/cpu/dense_linear.c and kernels/cpu/dense_grouped.c, through their ps_linear function):
  rowmajor  W [out, in] as stored (what builds without AVX-512 run, and matrices the grouped layout does not take),
  grouped   rows interleaved in groups of 16 at load (quant/dense_layout.py: what an AVX-512 build serves),
at 1, 2, 4 and 8 activation rows, on random bf16 weights (speed does not depend on the values). Each kernel cycles
over --copies copies of its matrix (default: enough for 64 MB) so the weights come from L3 or DRAM as in a served
model, not from L2; the kernels alternate over --rounds rounds. Per line: best microseconds per call and GB/s of
the weight bytes.

    python benchmarks/dense_gemv.py
    OMP_NUM_THREADS=1 python benchmarks/dense_gemv.py --rounds 6
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402

from pagedserve.quant.dense_layout import can_group, group_rows_in_place, grouped_isa  # noqa: E402
from pagedserve.quant.dense_native import dense_native_linear  # noqa: E402

# (name, out, in): q/k/v and gate/up merged as the engine merges them; the LM head is the tied embedding.
SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576))
_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)


def seconds_per_call(linears: list, x: torch.Tensor, y: torch.Tensor, calls: int) -> float:
    fns = [(_FN(lin.fn), lin.state) for lin in linears]
    for fn, state in fns:  # warm: each copy once
        fn(state, x.data_ptr(), x.shape[0], y.data_ptr())
    start = time.perf_counter()
    for i in range(calls):
        fn, state = fns[i % len(fns)]
        fn(state, x.data_ptr(), x.shape[0], y.data_ptr())
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--copies", type=int, default=0, help="copies per kernel (0: enough for 64 MB)")
    parser.add_argument("--shapes", nargs="+", default=[name for name, _, _ in SHAPES])
    args = parser.parse_args()
    for name, out, n_in in SHAPES:
        if name not in args.shapes:
            continue
        nbytes = out * n_in * 2
        copies = args.copies or max(1, -(-64_000_000 // nbytes))
        weights = [torch.randn(out, n_in).bfloat16() for _ in range(copies)]
        kernels = {"rowmajor": [dense_native_linear(w, None) for w in weights]}
        if can_group(weights[0]):
            grouped = [w.clone() for w in weights]
            for w in grouped:
                group_rows_in_place(w)
            kernels["grouped"] = [dense_native_linear(w, None) for w in grouped]
        calls = max(4 * copies, int(2e8 // nbytes))
        for rows in args.rows:
            x, y = torch.randn(rows, n_in), torch.empty(rows, out)
            best = {kernel: float("inf") for kernel in kernels}
            for _ in range(args.rounds):
                for kernel, linears in kernels.items():
                    best[kernel] = min(best[kernel], seconds_per_call(linears, x, y, calls))
            for kernel, seconds in best.items():
                print(json.dumps({"kind": "dense_gemv", "matrix": name, "out": out, "in": n_in, "rows": rows,
                                  "kernel": kernel, "us": round(seconds * 1e6, 1),
                                  "gb_s": round(nbytes / seconds / 1e9, 2), "copies": copies,
                                  "isa": grouped_isa(), "threads": torch.get_num_threads(), "cpu": cpu_model()}),
                      flush=True)


if __name__ == "__main__":
    main()
