"""The packed GGUF kernel at prefill-sized row counts against the dense companion quant/gguf.py would keep, on a
real file's matrices: microseconds per call, interleaved A/B, one JSON line per (matrix, rows), then a summary.

    PAGEDSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python benchmarks/packed_prefill.py --gguf FILE.gguf --rows 16 64 512 --output results.json

Kernels, on layer 0's matrices as the engine merges them (gate/up as one; q, k, v, o, down alone):
  packed  the interleaved-rows kernel over the file's blocks (packed_grouped.c / packed_grouped_wide.c: what
          quant/gguf.py serves up to its packed row limit),
  dense   the dense companion `--gguf-weights dequantized` keeps: the matrix expanded at load in the tier's compute
          dtype (fp32 where the host has no 16-bit arithmetic, bf16 with --dense-dtype bfloat16), oneDNN-packed,
  percall_rm (--per-call) what quant/gguf_prefill.py serves long chunks with where its host rule says, nothing held:
          the matrix dequantized per call into a row-major bf16 scratch (packed_grouped_bf16.c), then F.linear,
  percall (--per-call) the same scratch in the grouped layout kernels/cpu/dense_gemm.c reads, then that GEMM,
  linear  (--per-call) the lean path before: packed_dequantize.c's row-at-a-time bf16 rows, then F.linear.
Best of --repeats per kernel, the two taking turns so a noisy host's drift hits both alike; `ratio` = packed / dense.
With --threads 1 (the default) the time is also taken on the calling thread's CPU clock (`*_cpu_us`: both kernels
run on that thread then), which leaves out the time other processes held the core: the figure to compare on a
shared host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402

from pagedserve.kernels.cpu import isa  # noqa: E402
from pagedserve.kernels.cpu import packed as cpu_packed  # noqa: E402
from pagedserve.kernels.cpu.build import library_tier  # noqa: E402
from pagedserve.quant.onednn_dense import can_pack, pack_weight, packed_linear  # noqa: E402

MATRICES = {"q": ("attn_q",), "k": ("attn_k",), "v": ("attn_v",), "o": ("attn_output",),
            "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",), "head": ("output", "token_embd")}


def load(path: Path, name: str) -> tuple[str, torch.Tensor, int]:
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    if name == "head":  # the untied output matrix, else the tied embedding
        parts = [tensors.get("output.weight") or tensors["token_embd.weight"]]
    else:
        parts = [tensors[f"blk.0.{part}.weight"] for part in MATRICES[name]]
    qtypes = {t.tensor_type.name for t in parts}
    if len(qtypes) != 1:
        raise SystemExit(f"{name}: mixed types {qtypes}")
    blocks = torch.cat([torch.from_numpy(t.data.copy()) for t in parts])
    return qtypes.pop(), blocks.contiguous(), int(parts[0].shape[0])


def per_call_gemm(matrix: cpu_packed.PackedMatrix, x: torch.Tensor) -> torch.Tensor:
    """The grouped bf16 scratch multiplied by kernels/cpu/dense_gemm.c (this library's own AMX / vdpbf16ps GEMM)."""
    from pagedserve.quant.dense_native import dense_gemm, dense_native_linear

    w = torch.empty(matrix.out_features, matrix.in_features, dtype=torch.bfloat16)
    matrix.dequantize_grouped_bf16(0, matrix.out_features, w)
    w.pagedserve_row_group = cpu_packed.GROUP_ROWS
    return dense_gemm(dense_native_linear(w, None), x)


def per_call_linear(matrix: cpu_packed.PackedMatrix, x: torch.Tensor) -> torch.Tensor:
    from pagedserve.quant.gguf_prefill import dequantized_linear

    return dequantized_linear(matrix, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--matrices", nargs="+", default=["q", "down"], choices=list(MATRICES))
    parser.add_argument("--rows", nargs="+", type=int, default=[16, 64, 512])
    parser.add_argument("--dense-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--per-call", action="store_true", help="also time the per-call dequantizing kernels")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--conditions", default="noisy: other processes share the 2 cores")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pagedserve.engine.host.allocator import keep_freed_memory

    keep_freed_memory()  # as a CPU engine does: per-call scratch reused from the heap, not page-faulted afresh
    lib = cpu_packed.build()
    dtype = getattr(torch, args.dense_dtype)
    lines = []
    for name in args.matrices:
        qtype, blocks, inn = load(args.gguf, name)
        matrix = cpu_packed.PackedMatrix(qtype, blocks, inn, lib=lib)
        dense_w = matrix.dequantize(dtype=dtype)
        matrix = matrix.grouped()
        weight = pack_weight(dense_w) if can_pack(dense_w) else dense_w
        dense = (lambda x: packed_linear(x, weight, None)) if can_pack(dense_w) else (lambda x: torch.nn.functional.linear(x, weight))
        for rows in args.rows:
            x = torch.randn(rows, inn)
            xd = x.to(dtype)
            kernels = {"packed": lambda: matrix.matmul(x), "dense": lambda: dense(xd)}
            if args.per_call:
                xb = x.to(torch.bfloat16)
                kernels["percall"] = lambda: per_call_gemm(matrix, xb)
                kernels["percall_rm"] = lambda: per_call_linear(matrix, xb)
                kernels["linear"] = lambda: torch.nn.functional.linear(xb, matrix.dequantize(dtype=torch.bfloat16))
            for fn in kernels.values():
                fn()
            clocks = {"": time.perf_counter, "_cpu": time.thread_time} if args.threads == 1 else {"": time.perf_counter}
            best = {f"{k}{c}_us": float("inf") for k in kernels for c in clocks}
            for _ in range(args.repeats):
                for kernel, fn in kernels.items():
                    wall, cpu = time.perf_counter(), time.thread_time()
                    fn()
                    for c, clock in clocks.items():
                        took = (clock() - (wall if c == "" else cpu)) * 1e6
                        best[f"{kernel}{c}_us"] = min(best[f"{kernel}{c}_us"], took)
            key = "_cpu_us" if args.threads == 1 else "_us"
            line = {"matrix": name, "type": qtype, "out": blocks.shape[0], "in": inn, "rows": rows,
                    **{k: round(v, 1) for k, v in best.items()},
                    "ratio": round(best[f"packed{key}"] / best[f"dense{key}"], 3),
                    "packed_gflops": round(2 * rows * blocks.shape[0] * inn / best[f"packed{key}"] / 1e3, 1),
                    **{f"{k}_gflops": round(2 * rows * blocks.shape[0] * inn / best[f"{k}{key}"] / 1e3, 1)
                       for k in kernels if k != "packed"},
                    "grouped_isa": cpu_packed.grouped_isa(lib, qtype), "dense_dtype": args.dense_dtype}
            lines.append(line)
            print(json.dumps(line), flush=True)
    summary = {"benchmark": "packed_prefill", "cpu": cpu_model(), "tier": library_tier(lib),
               "host_tier": isa.host_tier(), "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""), "threads": args.threads,
               "repeats": args.repeats, "conditions": args.conditions, "load_avg_1m": os.getloadavg()[0],
               "gguf": args.gguf.name, "results": lines}
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    if args.output:
        args.output.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
