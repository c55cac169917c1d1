"""Micro-benchmark of the quantized linear kernels on CPU at SmolLM2-135M shapes (run by hand).

    python benchmarks/quant_tools/bench_kernels.py [--threads 2]

Compares, per call: F.linear on dense fp32 / bf16 weights, the cpu_int4 kernel (fp32 / bf16
activations) and the dequantize-per-call reference, for decode (M=1, 8) and prefill (M=128) batches.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from pagedserve.quant.cpu_int4 import CpuInt4Kernel
from pagedserve.quant.group_quant import DequantKernel, GroupQuantWeight
from pagedserve.quant.packing import default_g_idx, pack_cols, pack_rows

SHAPES = {"gate/up 576->1536": (576, 1536), "down 1536->576": (1536, 576), "q/o 576->576": (576, 576)}


def weight(k: int, n: int, group: int = 128) -> GroupQuantWeight:
    g = torch.Generator().manual_seed(0)
    g_idx = default_g_idx(k, group)
    groups = int(g_idx.max()) + 1
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    z = torch.randint(0, 16, (groups, n), generator=g, dtype=torch.int32)
    s = (torch.rand(groups, n, generator=g) * 0.02).half()
    return GroupQuantWeight(pack_rows(q, 4), pack_cols(z, 4), s, g_idx, 4, k, n)


def per_call_us(fn, x, iters: int) -> float:
    for _ in range(3):
        fn(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with torch.inference_mode():
        for label, (k, n) in SHAPES.items():
            w = weight(k, n)
            dense = w.dequantize(torch.float32)
            impls = {
                "dense fp32": (lambda x, d=dense: F.linear(x, d), torch.float32),
                "dense bf16": (lambda x, d=dense.bfloat16(): F.linear(x, d), torch.bfloat16),
                "cpu_int4 fp32": (CpuInt4Kernel.from_weight(w, torch.float32), torch.float32),
                "cpu_int4 bf16": (CpuInt4Kernel.from_weight(w, torch.bfloat16), torch.bfloat16),
                "dequant fp32": (DequantKernel.from_weight(w, torch.float32), torch.float32),
            }
            for m in (1, 8, 128):
                x = torch.randn(m, k)
                row = {"shape": label, "M": m}
                for name, (fn, dtype) in impls.items():
                    row[name] = round(per_call_us(fn, x.to(dtype), 200 if m < 128 else 50), 1)
                rows.append(row)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
