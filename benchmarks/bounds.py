"""Hardware bounds behind the CPU step: packed-GEMM speed at a model's own shapes, and how fast this machine reads
KV-cache-like scattered tiles. One JSON line per measurement (never in CI; run on a quiet machine).

    python benchmarks/bounds.py                        # SmolLM2-135M's shapes, bf16, all usable cores
    python benchmarks/bounds.py --dtype float32 --rows 1 40 512 --tile-bytes 2048 65536

GEMMs: each linear of one decoder layer (fused QKV, O, fused gate/up, down) and the LM head, through the same
oneDNN packed path the engine uses (quant/onednn_dense.py), at decode-sized and prefill-sized row counts.
Tiles: 256 MiB read in tiles of a given size, in a random order, by all threads (a small C loop built with the
machine's gcc, as the native kernels are): the ceiling for decode attention, which reads one 2 KiB tile per
(16-token block, KV head) at head_dim 64 in bf16. `stream_gb_s` is the same read in order.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402

from pagedserve.quant.onednn_dense import can_pack, pack_weight, packed_linear  # noqa: E402

# (name, in_features, out_features) of SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, intermediate 1536.
SMOLLM2 = (("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152))

TILE_READ_C = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
typedef float f32x16 __attribute__((vector_size(64)));
int main(int argc, char **argv) {
    const size_t tile = strtoul(argv[1], 0, 10), total = (size_t)256 << 20, n = total / tile;
    const int shuffled = atoi(argv[2]);
    char *buf = aligned_alloc(4096, total);
    memset(buf, 1, total);
    uint32_t *order = malloc(n * sizeof *order);
    for (size_t i = 0; i < n; i++) order[i] = (uint32_t)i;
    srand(1);
    for (size_t i = n - 1; shuffled && i > 0; i--) {
        size_t j = (size_t)rand() % (i + 1); uint32_t t = order[i]; order[i] = order[j]; order[j] = t;
    }
    double best = 1e30; float sink = 0;
    for (int rep = 0; rep < 5; rep++) {
        const double t0 = omp_get_wtime();
#pragma omp parallel for reduction(+ : sink) schedule(static)
        for (size_t i = 0; i < n; i++) {
            const char *p = buf + (size_t)order[i] * tile;
            f32x16 acc = {0};
            for (size_t line = 0; line < tile; line += 64) { f32x16 v; memcpy(&v, p + line, 64); acc += v; }
            sink += acc[0];
        }
        const double dt = omp_get_wtime() - t0;
        best = dt < best ? dt : best;
    }
    printf("%.3f %g\n", total / best / 1e9, sink);
    return 0;
}
"""


def gemm_gflops(rows: int, in_features: int, out_features: int, dtype: torch.dtype) -> float:
    weight = torch.randn(out_features, in_features, dtype=dtype)
    packed = pack_weight(weight) if can_pack(weight) else None
    x = torch.randn(rows, in_features, dtype=dtype)
    run = (lambda: packed_linear(x, packed, None)) if packed is not None else (lambda: x @ weight.T)
    for _ in range(3):
        run()
    calls = max(5, int(4e9 / (2 * rows * in_features * out_features)))
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return 2 * rows * in_features * out_features * calls / (time.perf_counter() - start) / 1e9


def tile_read_gb_s(tile_bytes: int, shuffled: bool, threads: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "tiles.c", Path(tmp) / "tiles"
        src.write_text(TILE_READ_C)
        subprocess.run(["gcc", "-O2", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        out = subprocess.run([str(exe), str(tile_bytes), str(int(shuffled))], check=True, capture_output=True,
                             text=True, env=env).stdout
    return float(out.split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 40, 64, 512])
    parser.add_argument("--tile-bytes", type=int, nargs="+", default=[2048, 4096, 65536])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(json.dumps({"benchmark": "bounds_setup", "cpu": cpu_model(), "threads": args.threads, "dtype": args.dtype,
                      "load_avg_before": os.getloadavg()[0]}), flush=True)
    for rows in args.rows:
        for name, fan_in, fan_out in SMOLLM2:
            print(json.dumps({"benchmark": "gemm", "rows": rows, "linear": name, "in": fan_in, "out": fan_out,
                              "gflop_s": round(gemm_gflops(rows, fan_in, fan_out, dtype), 1)}), flush=True)
    for tile in args.tile_bytes:
        print(json.dumps({"benchmark": "tile_read", "tile_bytes": tile, "threads": args.threads,
                          "random_gb_s": tile_read_gb_s(tile, True, args.threads),
                          "stream_gb_s": tile_read_gb_s(tile, False, args.threads)}), flush=True)
    print(json.dumps({"benchmark": "bounds_done", "load_avg_after": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
