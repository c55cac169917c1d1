"""The native prefill attention kernel of this tree against another commit's and against the SDPA path, one thread,
CPU time (`--threads N`: N threads for the kernel and torch, wall time), interleaved in one process (never in CI).

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head dim 64, blocks of 16), bf16 queries, per cache dtype: steps of
short prompts (16 x 16-64, 9 x 96, 9 x 160, 9 x 192 tokens), 4 chunks of 4-64 tokens over 1,024, the default
saturation workload's prefill step (9 prompts of 224 tokens), a 512- and a 1,024-token prompt, the two chunks of a
3,000-token prompt (2,048 new tokens, then 952 at 3,000) and the second chunk of a 4,096-token one. `--against COMMIT`
compiles that commit's kernels/cpu/prefill_attention.c (with its headers) with this tree's flags (the tier
PAGEDSERVE_CPU_ISA forces, or the host's); the SDPA column is the gather + torch SDPA path
(kernels/prefill_attention.py); over 8-bit caches the "gathered" column is the same native gather followed by this
tree's kernel over the contiguous bf16 blocks (cpu/prefill.py's LongPrefill), where "this" dequantizes the cache's
tiles inside each task. Prints one JSON object: median ms per call of each, the ratios, and the largest difference of
each kernel's output from SDPA's.

    OMP_NUM_THREADS=1 python benchmarks/prefill_attention_ab.py --against 14c20d1 --kv bf16 int8 --repeats 5

A Zen 4's bf16 tier (AVX512-BF16, no AMX) on an AMX host: the kernels forced to it, and oneDNN (SDPA's products)
kept off AMX too, or the SDPA column is an AMX one:

    PAGEDSERVE_CPU_ISA=avx512_bf16 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 OMP_NUM_THREADS=1 \
        python benchmarks/prefill_attention_ab.py --kv bf16 --cases 9x224 512 1024 952@3000 --repeats 9

`--mtune generic znver3 ...` also builds this tree (and `--against`'s commit) with each gcc -mtune in place of the
tier's -mtune=native, columns "this@znver3" and so on; the JSON names what -mtune=native is on this host's gcc
("generic" where gcc does not know the CPU). The AVX2 tier under three tunings against the commit before its ymm passes:

    PAGEDSERVE_CPU_ISA=avx2 OMP_NUM_THREADS=1 python benchmarks/prefill_attention_ab.py --against fd255d9 \
        --mtune generic sapphirerapids znver3 --kv bf16 int8 --cases 16x16 16x48 4x4@1024 9x96 --repeats 5
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import attention_cases  # noqa: E402
from fp8_kv_accuracy import host_info  # noqa: E402
from pagedserve.kernels.cpu import isa, native as cpu_native  # noqa: E402
from pagedserve.kernels.cpu.build import COMMON_FLAGS  # noqa: E402
from pagedserve.kernels.cpu.prefill import LongPrefill, PrefillBatch, long_prefill_native  # noqa: E402
from pagedserve.kernels.cpu.structs import PrefillArgs  # noqa: E402
from pagedserve.kernels.kv_cache import KVDtype  # noqa: E402
from pagedserve.kernels.prefill_attention import prefill_attention, prefill_chunks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CASES = {"16x16": ((16,) * 16, (16,) * 16), "16x32": ((32,) * 16, (32,) * 16), "16x48": ((48,) * 16, (48,) * 16),
         "16x64": ((64,) * 16, (64,) * 16), "9x96": ((96,) * 9, (96,) * 9), "9x160": ((160,) * 9, (160,) * 9),
         "9x192": ((192,) * 9, (192,) * 9), "9x224": ((224,) * 9, (224,) * 9), "4x4@1024": ((1024,) * 4, (4,) * 4),
         "4x8@1024": ((1024,) * 4, (8,) * 4), "4x16@1024": ((1024,) * 4, (16,) * 4),
         "4x32@1024": ((1024,) * 4, (32,) * 4), "4x64@1024": ((1024,) * 4, (64,) * 4), "512": ((512,), (512,)),
         "1024": ((1024,), (1024,)), "2048@2048": ((2048,), (2048,)), "952@3000": ((3000,), (952,)),
         "2048@4096": ((4096,), (2048,))}
SCALE = 0.125


def build_other(commit: str | None, tmp: Path, tune: str | None = None) -> ctypes.CDLL:
    """`commit`'s prefill kernels (None: this work tree's; every prefill_*.c, with the tile grant of dense_amx.c) as a
    shared object, for the tier PAGEDSERVE_CPU_ISA forces (as this tree's library is built), -march=native when unset;
    `tune`: -mtune=TUNE in place of the tier's -mtune=native (after -march=native when unset)."""
    if commit is None:
        names = [n.name for n in (ROOT / "kernels/cpu").iterdir()]
    else:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", commit, "kernels/cpu/"],
                                capture_output=True, text=True, check=True).stdout.split()
        names = [Path(n).name for n in listed]
    names = [n for n in names if n.endswith(".h") or n.startswith(("prefill_", "isa.c")) or n == "dense_amx.c"]
    for name in names:
        shown = (ROOT / "kernels/cpu" / name).read_bytes() if commit is None else subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{commit}:kernels/cpu/{name}"], capture_output=True).stdout
        (tmp / name).write_bytes(shown)
    target = tmp / "prefill_other.so"
    sources = [str(tmp / n) for n in names if n.endswith(".c")]
    flags = [f for f in isa.compile_flags(isa.requested_tier()) if not (tune and f == "-mtune=native")]
    subprocess.run(["gcc", *COMMON_FLAGS, *flags, *([f"-mtune={tune}"] if tune else []), *sources, "-o", str(target),
                    "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    lib.pagedserve_prefill_attention.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lib


def native_tune() -> str:
    """What gcc makes of -mtune=native here: "generic" on a CPU this gcc does not know."""
    out = subprocess.run(["gcc", "-mtune=native", "-Q", "--help=target"], capture_output=True, text=True).stdout
    return next((line.split()[-1] for line in out.splitlines() if line.strip().startswith("-mtune=")), "unknown")


def kernel_call(lib, query, layer, batch, count: int, threads: int = 1):
    out = torch.empty(query.shape, dtype=query.dtype)
    args = PrefillArgs(**cpu_native.attention_fields(query, out, layer, batch, SCALE),
                       query_lens=batch.query_lens.data_ptr())
    return out, lambda: lib.pagedserve_prefill_attention(ctypes.addressof(args), count, threads)


def one_case(libs: dict, kv: KVDtype, seq_lens, query_lens, repeats: int, threads: int = 1) -> dict:
    query, layer, meta = attention_cases.make_case(seq_lens, query_lens, 16, 3, kv, seed=1)
    query = query.to(torch.bfloat16)
    picked = tuple(range(len(seq_lens)))
    batch = PrefillBatch.of(meta, meta.query_starts(), None, picked)
    runs = {name: kernel_call(lib, query, layer, batch, len(seq_lens), threads) for name, lib in libs.items()}
    if kv is not KVDtype.BF16:
        parts, gathered_out = LongPrefill.of(layer, batch), torch.empty_like(query)
        runs["gathered"] = gathered_out, lambda: [long_prefill_native(query, gathered_out, layer, part, SCALE)
                                                  for part in parts]
    chunks, sdpa_out = prefill_chunks(meta, layer, meta.query_starts(), None, picked), torch.empty_like(query)
    gather = cpu_native.gather_kv_8bit if kv is not KVDtype.BF16 else None
    runs["sdpa"] = sdpa_out, lambda: [prefill_attention(query, sdpa_out, layer, SCALE, c, *(gather,) * bool(gather))
                                      for c in chunks]
    times: dict[str, list[float]] = {name: [] for name in runs}
    clock = time.process_time if threads == 1 else time.perf_counter  # CPU time alone; wall time on several threads
    for _ in range(repeats + 1):  # the first round warms up
        for name, (_, call) in runs.items():
            t0 = clock()
            call()
            times[name].append((clock() - t0) * 1e3)
    ms = {name: round(statistics.median(t[1:]), 2) for name, t in times.items()}
    diff = {name: (out.float() - sdpa_out.float()).abs().max().item() for name, (out, _) in runs.items()}
    return {"ms": ms, "ratios_vs_this": {n: round(v / ms["this"], 2) for n, v in ms.items()}, "max_diff_vs_sdpa": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default=None, help="a commit whose prefill_attention.c to time beside this tree's")
    p.add_argument("--kv", nargs="+", default=["bf16"], choices=["bf16", "int8", "fp8_e4m3"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="kernel and torch threads (above 1: wall time per call)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--conditions", default="unstated", help="e.g. quiet, or noisy (other work on the cores)")
    p.add_argument("--mtune", nargs="+", default=[], help="also build this tree (and --against) with each -mtune")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    attention_cases.NUM_KV_HEADS = 3
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"this": cpu_native.load_library()}
        if args.against:
            libs[args.against] = build_other(args.against, Path(tmp))
        for tune in args.mtune:
            for commit in (None, args.against) if args.against else (None,):
                folder = Path(tmp) / f"{commit or 'this'}-{tune}"
                folder.mkdir()
                libs[f"{commit or 'this'}@{tune}"] = build_other(commit, folder, tune)
        results = {kv: {name: one_case(libs, KVDtype.parse(kv, torch.bfloat16), *case, args.repeats,
                                                   args.threads)
                        for name, case in CASES.items() if name in args.cases} for kv in args.kv}
    forced = isa.requested_tier()
    # SDPA's bf16 products go through oneDNN, which takes AMX where the host has it whatever tier the kernels are
    # forced to: ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 is what makes the SDPA column a Zen 4's (no AMX) on such a host.
    print(json.dumps({"benchmark": "prefill_attention_ab", "host": host_info(), "conditions": args.conditions,
                      "kernel_tier": forced.name if forced else isa.NATIVE,
                      "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "unset"),
                      "gcc_mtune_native": native_tune(),
                      "amx_prefill": bool(libs["this"].pagedserve_prefill_amx(64)), "results": results}, indent=1))


if __name__ == "__main__":
    main()
