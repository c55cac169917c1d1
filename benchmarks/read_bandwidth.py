"""How fast these cores read memory, and what that bounds a single decode stream to: one JSON line.

A decode step of one stream reads every weight once, so weight bytes per token / read bandwidth is the floor of its
inter-token time and its inverse the ceiling of tokens/s. The bandwidth is measured by summing a buffer far larger
than the caches with the threads the engine uses (torch's pool); the sum's arithmetic is negligible next to the
read, so it is a read-bandwidth measurement, best of `--repeats`. Weight bytes per token: the GGUF file's tensor
bytes, less the embedding where the file has its own LM head (the lookup reads one row of it; a tied head reads all
of it, once).

    python benchmarks/read_bandwidth.py --gguf FILE [--tok-s 44.1 ...]   # the bound, and each rate's fraction of it
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from contention import cpu_model


def read_bandwidth(gib: float, repeats: int) -> float:
    """Bytes per second that torch's threads read from a `gib` GiB buffer (best of `repeats`)."""
    buffer = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    buffer.sum()  # touch every page once before timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def weight_bytes_per_token(gguf_path: str) -> int:
    from gguf import GGUFReader

    tensors = GGUFReader(gguf_path).tensors
    total = sum(int(t.n_bytes) for t in tensors)
    if any(t.name == "output.weight" for t in tensors):
        total -= next(int(t.n_bytes) for t in tensors if t.name == "token_embd.weight")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True, help="the model file whose weights one decode step reads")
    parser.add_argument("--tok-s", type=float, nargs="*", default=[], help="measured single-stream rates to place")
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth(args.gib, args.repeats)
    per_token = weight_bytes_per_token(args.gguf)
    bound = bandwidth / per_token
    print(json.dumps({"cpu": cpu_model(), "threads": args.threads, "read_gb_s": round(bandwidth / 1e9, 2),
                      "weight_bytes_per_token": per_token, "bound_tok_s": round(bound, 1),
                      "fraction_of_bound": {str(rate): round(rate / bound, 3) for rate in args.tok_s}}))


if __name__ == "__main__":
    main()
