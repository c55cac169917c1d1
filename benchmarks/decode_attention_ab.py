"""Native CPU decode attention, this tree against a git revision: one layer's time on SmolLM2-135M's shapes.

    python benchmarks/decode_attention_ab.py                          # against main, 2 threads
    python benchmarks/decode_attention_ab.py --base 544a80e --threads 2 --pairs 9

Builds the decode attention C files of `--base` (from `git show`) and of this tree into two objects, then times a
step's worth of layers (30 caches, so K/V come from memory as in a real step, not from a hot L2) at each case:
1 row, a 5-row span (a row and 4 speculative drafts) and 16 distinct sequences, at contexts 300/800/1500. fp32
queries over a bf16 cache, as the native decode step calls it. A and B alternate `--pairs` times; prints one JSON
object: per case the median us per layer of each and their ratio (base / this tree: > 1 means this tree is faster),
with the CPU model and the load average before and after. Times are per call (one layer), median and 10th
percentile over the calls. `--kv int8` (or fp8_e4m3) times that cache instead of bf16 and `--contexts` sets the
context lengths, e.g. the 8-bit decode at 4k keys:

    python benchmarks/decode_attention_ab.py --base main --kv int8 --contexts 4096 --rows 1 16

`--dtypes bf16 int8 fp8_e4m3` times this tree alone over each cache dtype instead (no base), dtypes alternated, and
prints per case each one's 10th-percentile us per call, us per row over the 30 layers and ratio to the first dtype;
`--block-sizes` and `--pages huge 4k` add those settings to the alternation (the caches are on huge pages as the
engine's are, kernels/huge_pages.py, unless `4k` is asked for):

    python benchmarks/decode_attention_ab.py --dtypes bf16 int8 fp8_e4m3 --contexts 3600 --rows 1 2 4 --threads 1
    python benchmarks/decode_attention_ab.py --dtypes bf16 int8 --pages 4k huge --contexts 1500 4096 --rows 4 16
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.kernels import huge_pages
from pagedserve.kernels.cpu import isa
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.build import COMMON_FLAGS
from pagedserve.kernels.cpu.structs import DecodeArgs

ROOT = Path(__file__).resolve().parent.parent
LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 30, 9, 3, 64, 16


def _build(sources: dict[str, str], folder: Path, name: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """sources: file name -> text; all the .c ones compiled into one object with the engine's flags."""
    for file, text in sources.items():
        (folder / file).write_text(text)
    target = folder / f"{name}.so"
    c_files = [str(folder / f) for f in sources if f.endswith(".c")]
    flags = (*COMMON_FLAGS, *isa.compile_flags(isa.requested_tier()))
    subprocess.run(["gcc", *flags, *defines, *c_files, "-o", str(target), "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    lib.pagedserve_decode_attention.argtypes = [ctypes.POINTER(DecodeArgs), ctypes.c_int64,
                                                ctypes.c_int64, ctypes.c_int]
    return lib


def _sources(rev: str | None) -> dict[str, str]:
    """The decode attention's C files and the headers they include, at `rev` (None: this tree), under the names they
    include each other by (kernels/cpu/NAME; revisions before that folder: kernels/cpu_NAME)."""
    names = ("isa.h", "native.h", "lanes.h", "kv_dot.h", "kv_values.h", "decode_attention.h", "decode_attention.c",
             "decode_scores.h", "decode_chunks.h", "decode_tasks.c")
    out = {}
    for name in names:
        if rev is None:
            path = ROOT / "kernels" / "cpu" / name
            if path.exists():
                out[name] = path.read_text()
            continue
        for stored in (f"kernels/cpu/{name}", f"kernels/cpu_{name}"):
            shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{stored}"], capture_output=True, text=True)
            if shown.returncode == 0:
                out[stored.rsplit("/", 1)[1]] = shown.stdout
                break
    return out


KV_CODES = {"bf16": 1, "fp8_e4m3": 3, "int8": 5}  # DT_* in kernels/cpu/native.h


def _cache(kv: str, shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K/V storage of dtype kv and, for int8, its row scales; values spread like a calibrated cache's (FP8: std 28,
    so that subnormals are as rare as in the engine's cache)."""
    x = torch.randn(*shape, generator=gen)
    if kv == "bf16":
        return x.to(torch.bfloat16), None
    if kv == "fp8_e4m3":
        return (x * 28).to(torch.float8_e4m3fn).view(torch.uint8), None
    scales = (torch.rand(*shape[:-1], generator=gen) * 0.02 + 0.01).to(torch.float16)
    return (x * 40).round().clamp(-127, 127).to(torch.int8), scales


def _on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of t in memory on huge pages, as the engine's KV cache (kernels/huge_pages.py)."""
    out = huge_pages.carve(huge_pages.zeroed_bytes(t.numel() * t.element_size()), 0, tuple(t.shape), t.dtype)
    return out.copy_(t)


class Case:
    """A step's decode rows over LAYERS scattered caches: `rows` rows, `spans` of them sharing a sequence."""

    def __init__(self, rows: int, span: int, context: int, seed: int = 0, kv: str = "bf16",
                 layout: str = "scattered", block: int = BLOCK, huge: bool = False) -> None:
        gen = torch.Generator().manual_seed(seed)
        seqs = rows // span
        per_seq = -(-(context + span) // block)
        self.block = block
        self.num_blocks = seqs * per_seq + 4
        self.kv = kv
        self.caches = [_cache(kv, (2, KV_HEADS, self.num_blocks, block, DIM), gen) for _ in range(LAYERS)]
        if huge:
            self.caches = [(_on_huge_pages(c), s if s is None else _on_huge_pages(s)) for c, s in self.caches]
        # scattered: every block anywhere; contiguous: each sequence's blocks in order, as a prefill takes them from
        # the block manager's free list
        order = (torch.randperm(self.num_blocks, generator=gen) if layout == "scattered"
                 else torch.arange(self.num_blocks)).to(torch.int32)
        tables = torch.stack([order[s * per_seq : (s + 1) * per_seq] for s in range(seqs) for _ in range(span)])
        self.tables = tables.contiguous()
        self.lens = torch.tensor([context + i % span for i in range(rows)], dtype=torch.int32)
        self.rows = torch.arange(rows, dtype=torch.int64)
        self.query = torch.randn(rows, HEADS, DIM, generator=gen)
        self.out = torch.empty_like(self.query)
        self.scales = torch.ones(KV_HEADS)
        self.args = [self._args(c) for c in self.caches]

    def _args(self, cache: tuple[torch.Tensor, torch.Tensor | None]) -> cpu_native.DecodeArgs:
        cache, row_scales = cache
        return cpu_native.DecodeArgs(
            query=self.query.data_ptr(), q_token_stride=HEADS * DIM, out=self.out.data_ptr(), q_dtype=0,
            k_cache=cache[0].data_ptr(), v_cache=cache[1].data_ptr(), kv_dtype=KV_CODES[self.kv],
            k_scale=self.scales.data_ptr(), v_scale=self.scales.data_ptr(),
            k_row_scale=None if row_scales is None else row_scales[0].data_ptr(),
            v_row_scale=None if row_scales is None else row_scales[1].data_ptr(),
            block_tables=self.tables.data_ptr(), block_table_stride=self.tables.stride(0),
            seq_lens=self.lens.data_ptr(), rows=self.rows.data_ptr(),
            num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, num_blocks=self.num_blocks, block_size=self.block,
            scale=DIM**-0.5, window=0,
        )

    def time_us(self, lib: ctypes.CDLL, threads: int, steps: int) -> tuple[float, float]:
        """The median and the 10th percentile over `steps` x LAYERS calls of one call's time: per call, so that a
        busy host's preemptions spoil a few calls, not whole steps."""
        n, longest = len(self.rows), int(self.lens.max())
        times = []
        for _ in range(steps):
            for args in self.args:
                start = time.perf_counter_ns()
                lib.pagedserve_decode_attention(ctypes.byref(args), n, longest, threads)
                times.append((time.perf_counter_ns() - start) / 1e3)
        times.sort()
        return times[len(times) // 2], times[len(times) // 10]


def _summary(rows: int, span: int, context: int, a: list, b: list) -> dict:
    """a, b: (median, 10th percentile) per alternation, of the base and of this tree."""
    med_a, med_b = statistics.median(x[0] for x in a), statistics.median(x[0] for x in b)
    least_a, least_b = statistics.median(x[1] for x in a), statistics.median(x[1] for x in b)
    ratios = [x[0] / y[0] for x, y in zip(a, b)]
    return dict(rows=rows, span=span, context=context, base_us=round(med_a, 1), this_us=round(med_b, 1),
                ratio=round(med_a / med_b, 3), ratio_range=[round(min(ratios), 3), round(max(ratios), 3)],
                base_p10_us=round(least_a, 1), this_p10_us=round(least_b, 1), p10_ratio=round(least_a / least_b, 3))


def compare_dtypes(lib: ctypes.CDLL, args: argparse.Namespace) -> list[dict]:
    """This tree over each of args.dtypes (and each of args.block_sizes and args.pages: keys "dtype/block/pages"),
    alternated `--pairs` times per case; the least 10th percentile of each."""
    results = []
    for rows in args.rows:
        for context in args.contexts:
            cases = {}
            for kv in args.dtypes:
                for bs in args.block_sizes:
                    for pages in args.pages:
                        parts = [kv, str(bs) if len(args.block_sizes) > 1 else "", pages if len(args.pages) > 1 else ""]
                        name = "/".join(p for p in parts if p)
                        cases[name] = Case(rows, 1, context, kv=kv, layout=args.layout, block=bs, huge=pages == "huge")
            best = {kv: float("inf") for kv in cases}
            for _ in range(args.pairs):
                for kv, case in cases.items():
                    best[kv] = min(best[kv], case.time_us(lib, args.threads, args.steps)[1])
            first = next(iter(best.values()))
            results.append(dict(rows=rows, context=context, p10_us={kv: round(t, 1) for kv, t in best.items()},
                                us_per_row_all_layers={kv: round(LAYERS * t / rows) for kv, t in best.items()},
                                vs_first={kv: round(t / first, 3) for kv, t in best.items()}))
            print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="main", help="git revision to compare against")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=7, help="A/B alternations per case")
    parser.add_argument("--steps", type=int, default=40, help="steps per timing")
    parser.add_argument("--key-chunk", type=int, help="build this tree with -DKEY_CHUNK=N (kernels/cpu/decode_chunks.h)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 16], help="1: one row, 5: a span, 16: batch")
    parser.add_argument("--kv", default="bf16", choices=sorted(KV_CODES), help="the cache dtype timed")
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 800, 1500])
    parser.add_argument("--layout", default="scattered", choices=["scattered", "contiguous"],
                        help="blocks of a sequence at random places, or in order")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(KV_CODES), help="this tree over these caches, no base")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[BLOCK],
                        help="with --dtypes: each cache dtype at each of these tokens per block")
    parser.add_argument("--pages", nargs="+", choices=["huge", "4k"], default=["huge"],
                        help="with --dtypes: caches on huge pages (as the engine allocates them) and/or 4 KiB pages")
    args = parser.parse_args()
    load_before = os.getloadavg()
    if args.dtypes:
        with tempfile.TemporaryDirectory() as tmp:
            results = compare_dtypes(_build(_sources(None), Path(tmp), "this"), args)
        print(json.dumps(dict(dtypes=args.dtypes, block_sizes=args.block_sizes, pages=args.pages, threads=args.threads,
                              layout=args.layout, cpu=_cpu(), tier=_tier(), cores=os.cpu_count(),
                              load_before=load_before,
                              load_after=os.getloadavg(), cases=results)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = _build(_sources(args.base), Path(tmp), "base")
        defines = (f"-DKEY_CHUNK={args.key_chunk}",) if args.key_chunk else ()
        this = _build(_sources(None), Path(tmp), "this", defines)
        results = []
        for rows, span in [(r, 5 if r == 5 else 1) for r in args.rows]:
            for context in args.contexts:
                case = Case(rows, span, context, kv=args.kv, layout=args.layout, huge=args.pages[0] == "huge")
                a, b = [], []
                for _ in range(args.pairs):
                    a.append(case.time_us(base, args.threads, args.steps))
                    b.append(case.time_us(this, args.threads, args.steps))
                results.append(_summary(rows, span, context, a, b))
                print(json.dumps(results[-1]), flush=True)
    print(json.dumps(dict(base=args.base, kv=args.kv, threads=args.threads, layout=args.layout, cpu=_cpu(),
                          tier=_tier(), cores=os.cpu_count(), load_before=load_before, load_after=os.getloadavg(),
                          cases=results)))


def _tier() -> str:
    """The ISA tier both objects were built for: PAGEDSERVE_CPU_ISA's, or the host's under -march=native."""
    forced = isa.requested_tier()
    return forced.name if forced else f"native ({isa.host_tier()})"


def _cpu() -> str:
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor())


if __name__ == "__main__":
    main()
