"""The 8-bit KV write and gather of a long prefill chunk (kernels/cpu/kv_write.c), this tree against a git revision,
one layer on SmolLM2-135M's shapes (never in CI).

    python benchmarks/kv_write_ab.py --base 8dd5f2d --pairs 7 --threads 1 --label noisy --json OUT.json

Builds kv_write.c and the headers it includes at `--base` (from `git show`) and in this tree into two objects, then
times what an 8-bit cache's prefill does per layer beside the attention: writing `--new` tokens' K and V (bf16 rows
of 3 KV heads x 64, scattered slots) into an int8 and an FP8 (e4m3) cache, and gathering `--context` keys of each
back into contiguous bf16 (the long chunks' `gather_kv_8bit`). A and B alternate `--pairs` times, each timing the
best of `--calls`; prints and writes one JSON object: per case the median over pairs of each side's ms per layer
and base / this (> 1: this tree is faster), with the CPU model, ISA flags and load average before and after.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, even under python -P
from fp8_kv_accuracy import host_info  # noqa: E402
from pagedserve.kernels.cpu.build import COMMON_FLAGS  # noqa: E402
from pagedserve.kernels.kv_quant import quantize_rows_int8  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KV_HEADS, DIM, BLOCK = 3, 64, 16
DT_BF16, DT_E4M3, DT_I8 = 1, 3, 5  # kernels/cpu/native.h


def _sources(rev: str | None) -> dict[str, str]:
    """kv_write.c and every header of kernels/cpu at `rev` (None: this tree)."""
    if rev is None:
        folder = ROOT / "kernels" / "cpu"
        return {p.name: p.read_text() for p in (folder / "kv_write.c", *sorted(folder.glob("*.h")))}
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "kernels/cpu/"],
                            capture_output=True, text=True, check=True).stdout.split()
    names = [n for n in listed if n.endswith(".h") or n.endswith("/kv_write.c")]
    return {n.rsplit("/", 1)[1]: subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{n}"], capture_output=True,
                                                text=True, check=True).stdout for n in names}


def _build(sources: dict[str, str], folder: Path) -> ctypes.CDLL:
    folder.mkdir()
    for name, text in sources.items():
        (folder / name).write_text(text)
    target = folder / "kv_write.so"
    subprocess.run(["gcc", *COMMON_FLAGS, "-march=native", str(folder / "kv_write.c"), "-o", str(target), "-lm"],
                   check=True)
    return ctypes.CDLL(str(target))


class Layer:
    """One layer's tensors: new rows, an int8 and an FP8 cache of context + new slots, their scales, tiles."""

    def __init__(self, context: int, new: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.new, self.blocks = new, -(-(context + new) // BLOCK)
        slots = self.blocks * BLOCK
        self.k = torch.randn(new, KV_HEADS, DIM, generator=gen).to(torch.bfloat16)
        self.v = torch.randn(new, KV_HEADS, DIM, generator=gen).to(torch.bfloat16)
        self.slots = torch.randperm(slots, generator=gen)[:new].contiguous()
        # What the writes store from Gaussian rows: FP8 under calibration's scale (4 x amax / 448: e4m3
        # subnormals, which cost some conversions a microcode assist, as rare as in a real cache).
        rows = [torch.randn(KV_HEADS, slots, DIM, generator=gen) for _ in range(2)]
        self.head_scales = tuple(r.abs().amax(dim=(1, 2)) * (4 / 448) for r in rows)
        int8 = [quantize_rows_int8(r) for r in rows]
        self.row_scales = tuple(scales for _, scales in int8)
        self.storage = {"int8": tuple(q for q, _ in int8),
                        "fp8": tuple((r / s[:, None, None]).to(torch.float8_e4m3fn).view(torch.int8)
                                     for r, s in zip(rows, self.head_scales))}
        picked = torch.randperm(self.blocks, generator=gen)[: context // BLOCK]
        self.tiles = (torch.arange(KV_HEADS)[:, None] * self.blocks + picked[None, :]).reshape(-1).contiguous()
        self.out = torch.empty(KV_HEADS, picked.numel() * BLOCK, DIM, dtype=torch.bfloat16)

    def write(self, lib: ctypes.CDLL, kv: str) -> int:
        k, v = self.storage[kv]
        common = (self.slots.data_ptr(), self.new, KV_HEADS, self.blocks * BLOCK, DIM)
        if kv == "int8":
            return lib.pagedserve_write_kv_int8(
                self.k.data_ptr(), KV_HEADS * DIM, self.v.data_ptr(), KV_HEADS * DIM, DT_BF16, k.data_ptr(),
                v.data_ptr(), self.row_scales[0].data_ptr(), self.row_scales[1].data_ptr(), *common)
        return lib.pagedserve_write_kv_fp8(
            self.k.data_ptr(), KV_HEADS * DIM, self.v.data_ptr(), KV_HEADS * DIM, DT_BF16, DT_E4M3, k.data_ptr(),
            v.data_ptr(), self.head_scales[0].data_ptr(), self.head_scales[1].data_ptr(), *common)

    def gather(self, lib: ctypes.CDLL, kv: str, threads: int) -> int:
        status = 0
        for i in range(2):
            status |= lib.pagedserve_gather_kv(
                self.storage[kv][i].data_ptr(), DT_I8 if kv == "int8" else DT_E4M3, self.row_scales[i].data_ptr(),
                self.head_scales[i].data_ptr(), self.tiles.data_ptr(), self.tiles.numel() // KV_HEADS, KV_HEADS,
                KV_HEADS * self.blocks, BLOCK, DIM, self.out.data_ptr(), DT_BF16, threads)
        return status


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pagedserve_write_kv_int8.argtypes = [p, i64, p, i64, c_int, p, p, p, p, p, i64, i64, i64, i64]
    lib.pagedserve_write_kv_fp8.argtypes = [p, i64, p, i64, c_int, c_int, p, p, p, p, p, i64, i64, i64, i64]
    lib.pagedserve_gather_kv.argtypes = [p, c_int, p, p, p, i64, i64, i64, i64, i64, p, c_int, c_int]


def best_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        assert fn() == 0
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="git revision to compare against")
    parser.add_argument("--context", type=int, default=4096, help="keys gathered")
    parser.add_argument("--new", type=int, default=2048, help="tokens written")
    parser.add_argument("--threads", type=int, default=1, help="the gather's OpenMP threads (the write is serial)")
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--label", default="", help="e.g. 'noisy' when other jobs share the machine")
    parser.add_argument("--json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    layer = Layer(args.context, args.new)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": _build(_sources(args.base), Path(tmp) / "base"), "this": _build(_sources(None), Path(tmp) / "this")}
        for lib in libs.values():
            _declare(lib)
        cases = {f"{kv} {what}": (lambda lib, kv=kv, what=what: layer.write(lib, kv) if what == "write"
                                  else layer.gather(lib, kv, args.threads))
                 for kv in ("int8", "fp8") for what in ("write", "gather")}
        times = {name: {"base": [], "this": []} for name in cases}
        for _ in range(args.pairs):
            for name, fn in cases.items():
                for side, lib in libs.items():
                    times[name][side].append(best_ms(lambda: fn(lib), args.calls))
    rows = []
    for name, sides in times.items():
        base, this = statistics.median(sides["base"]), statistics.median(sides["this"])
        rows.append({"case": name, "base_ms": round(base, 4), "this_ms": round(this, 4),
                     "base_over_this": round(base / this, 3), "pairs": sides})
        print(f"{name:12s} base {base:.3f} ms  this {this:.3f} ms  base/this {base / this:.2f}", flush=True)
    result = {**host_info(), "label": args.label, "args": vars(args), "load_before": load_before,
              "load_after": os.getloadavg(), "cases": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
