"""One stream's linears as a decode step reads them, per ISA tier or kernel build: where a token's weight reads go.

Every linear of a GGUF model (q/k/v and gate/up merged where their types match, as the engine merges them; the LM
head, tied or not) is loaded once with its rows grouped (the interleaved-rows layout the loaders serve), then each
"token" calls them in a decode step's order with one activation row, the builds interleaved token by token so noise
hits them alike. A step streams ~1 GB through the caches, so each call reads from memory as in serving (a one-matrix
loop would read from the last-level cache). Prints one JSON line per build and linear kind (ms per token, GB/s of
its weight bytes, best and median over tokens), then a summary with the read probe of benchmarks/read_bandwidth.py.

    python benchmarks/packed_token_sweep.py --gguf FILE --builds native avx2 --tokens 20
    python benchmarks/packed_token_sweep.py --gguf FILE --builds avx2 avx2@/tmp/old-kernels   # an A/B of sources

A build is a tier name of kernels/cpu/isa.py ("native" for -march=native), or TIER@DIR: that tier's flags on the
packed library's C files in DIR (a copy of kernels/cpu/ from another commit, say), compiled here.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import cpu_model  # noqa: E402
from read_bandwidth import read_bandwidth  # noqa: E402

from pagedserve.kernels.cpu import build as cpu_build  # noqa: E402
from pagedserve.kernels.cpu import isa  # noqa: E402
from pagedserve.kernels.cpu import packed as cpu_packed  # noqa: E402

KINDS = (("qkv", ("attn_q", "attn_k", "attn_v")), ("o", ("attn_output",)), ("gate_up", ("ffn_gate", "ffn_up")),
         ("down", ("ffn_down",)))


def library(build: str) -> ctypes.CDLL:
    """The packed library of `build` (a tier name, or TIER@DIR: see the module's docstring)."""
    if "@" not in build:
        return cpu_packed.build(build)
    tier, folder = build.split("@", 1)
    flags = (*cpu_build.COMMON_FLAGS, *isa.compile_flags(None if tier == isa.NATIVE else isa.check_available(tier)))
    sources = [str(Path(folder) / s) for s in ("isa.c", *cpu_packed.SPEC.sources)]
    target = Path(tempfile.mkdtemp()) / "packed.so"
    subprocess.run(["gcc", *flags, "-I", folder, *sources, "-o", str(target), "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    cpu_packed.SPEC.declare(lib)
    cpu_build.library_tier(lib)
    return lib


def linears(path: str, group_lib: ctypes.CDLL) -> list[tuple[str, str, int, torch.Tensor]]:
    """(kind, GGUF type, in_features, grouped blocks) in a step's order: per layer q/k/v, o, gate/up, down; then the
    head. Parts of a kind with different types stay apart."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    layers = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))
    out = []

    def add(kind: str, names: list[str]) -> None:
        first = tensors[names[0]]
        blocks = torch.from_numpy(np.concatenate([np.array(tensors[n].data) for n in names]))
        matrix = cpu_packed.PackedMatrix(first.tensor_type.name, blocks, int(first.shape[0]), lib=group_lib)
        out.append((kind, first.tensor_type.name, int(first.shape[0]), matrix.grouped().blocks))

    for layer in range(layers):
        for kind, parts in KINDS:
            names = [f"blk.{layer}.{p}.weight" for p in parts]
            types = [tensors[n].tensor_type for n in names]
            for run in ([names] if len(set(types)) == 1 else [[n] for n in names]):
                add(kind, run)
    add("head", ["output.weight" if "output.weight" in tensors else "token_embd.weight"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--builds", nargs="+", default=["native", "avx2"])
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="thread: the calling thread's CPU time (with --threads 1 all the kernel's work), which a "
                        "busy host's time slicing does not inflate")
    parser.add_argument("--conditions", default="unstated", help="recorded as is: quiet, noisy (what else ran)")
    parser.add_argument("--output", type=Path, help="also append the JSON lines here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread measures the calling thread only: use it with --threads 1")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    libs = {b: library(b) for b in args.builds}
    mats = linears(args.gguf, libs[args.builds[0]])
    calls = {b: [(kind, cpu_packed.PackedMatrix(qtype, blocks, inn, lib=lib, row_group=cpu_packed.GROUP_ROWS),
                  torch.randn(1, inn)) for kind, qtype, inn, blocks in mats] for b, lib in libs.items()}
    times = {b: [] for b in args.builds}  # per token: {kind: seconds}
    for token in range(args.tokens + 1):
        order = args.builds if token % 2 == 0 else args.builds[::-1]
        for b in order:
            spent: dict[str, float] = {}
            for kind, matrix, x in calls[b]:
                start = clock()
                matrix.matmul(x)
                spent[kind] = spent.get(kind, 0.0) + clock() - start
            if token:  # the first token warms the pages and thread pool
                times[b].append(spent)
    nbytes: dict[str, int] = {}
    for kind, _, _, blocks in mats:
        nbytes[kind] = nbytes.get(kind, 0) + blocks.numel()
    nbytes["total"] = sum(nbytes.values())
    lines = []
    for b in args.builds:
        per_token = [{**t, "total": sum(t.values())} for t in times[b]]
        for kind in nbytes:
            ts = [t[kind] for t in per_token]
            lines.append({"build": b, "tier": cpu_build.library_tier(libs[b]), "kind": kind,
                          "isa": sorted({cpu_packed.grouped_isa(libs[b], q) for k, q, _, _ in mats
                                         if k == kind or kind == "total"}),
                          "mb": round(nbytes[kind] / 1e6, 1), "ms_best": round(1e3 * min(ts), 2),
                          "ms_median": round(1e3 * statistics.median(ts), 2),
                          "gb_s_best": round(nbytes[kind] / min(ts) / 1e9, 2),
                          "gb_s_median": round(nbytes[kind] / statistics.median(ts) / 1e9, 2)})
    probe = read_bandwidth(2.0, 5)
    summary = {"benchmark": "packed_token_sweep", "gguf": Path(args.gguf).name, "cpu": cpu_model(),
               "host_tier": isa.host_tier(), "threads": args.threads, "tokens": args.tokens, "clock": args.clock,
               "read_probe_gb_s": round(probe / 1e9, 2), "conditions": args.conditions,
               "load_avg_1m": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M")}
    for line in lines:
        line["fraction_of_probe"] = round(line["gb_s_median"] * 1e9 / probe, 3)
    with (args.output.open("a") if args.output else open(os.devnull, "w")) as sink:
        for line in (*lines, summary):
            print(json.dumps(line), flush=True)
            sink.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
