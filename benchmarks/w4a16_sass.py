"""The split-K GEMV's machine code for an H100/H200, counted on a host without a GPU: instructions per 4-bit code.

    python benchmarks/w4a16_sass.py        # TRITON_INTERPRET unset; needs the ptxas/cuobjdump Triton's wheel carries

A decode GEMV that reads weights at copy speed must also issue its instructions in that time: an H200 issues about
30 T lane-instructions a second (132 SMs x 4 schedulers x 32 lanes x ~1.75 GHz) while copy bandwidth (4.2 TB/s)
brings 8.4 T 4-bit codes, so about 3.5 instructions a code, and less where anything else stalls. This compiles
quant/w4a16_splitk.py's launches (as the rule runs them, fp16 and 4-bit, with and without the act-order gather, the
`in_place` variant, the `half2` one at ONE_ROW's tile and at 1024 columns, 16 a thread, the latter with bf16
activations too, ROWS with and without `pairs`, fp16 and bf16, and the bench's 32- and 64-row tiles) for sm_90,
disassembles them with cuobjdump and prints JSON: per launch, the SASS instructions, the 4-bit codes one thread
handles, their ratio, ptxas's registers and spills, the shared memory and the most frequent opcodes. Static counts of
the straight-line kernel (a program runs its K span unrolled, no loop), so they are what each program executes.
Counts are not speeds: a device run decides.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedserve.quant import w4a16_splitk as splitk

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ARGS = ("x_ptr", "perm_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", "ws_ptr", "count_ptr", "M", "N", "K", "GROUP",
        "stride_xm", "stride_qk", "stride_sg", "magic")
TYPES = ("*fp16", "*i64", "*i32", "*fp16", "*fp16", "*fp16", "*fp32", "*i32") + ("i32",) * 8


def compile_sm90(fn, args: tuple[str, ...], types: tuple[str, ...] | list[str], constants: dict, num_warps: int,
                 num_stages: int):
    """`fn` compiled for sm_90 as a launch would be: the runtime specializes pointers and 16-divisible ints (every
    stride and width here but M, the rows) as divisible by 16."""
    signature = {**dict(zip(args, types)), **{name: "constexpr" for name in constants}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(args) if name != "M"}
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_launch(cfg: splitk.SplitKConfig, rows: int, permuted: bool, act: str = "fp16"):
    block_m = 1 if rows == 1 else cfg.block_m
    constants = dict(BITS=4, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, K_STEPS=cfg.k_steps,
                     PERMUTED=permuted, DOT_16BIT=True, UNPACK=cfg.unpack, IN_PLACE=cfg.in_place, HALF2=cfg.half2,
                     PAIRS=cfg.pairs and rows > 1, LAST=cfg.reduce == "last")
    types = [t.replace("fp16", act) if name in ("x_ptr", "out_ptr") else t for name, t in zip(ARGS, TYPES)]
    return compile_sm90(splitk._splitk_kernel, ARGS, types, constants, cfg.num_warps, cfg.num_stages)


def opcodes(cubin: bytes) -> collections.Counter:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout
    found = re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass)
    return collections.Counter(match.group(1) for match in found)


def ptxas_usage(ptx: str) -> dict:
    """ptxas's registers a thread and spilled bytes for the kernel (the compiled object's own fields need a GPU)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        report = subprocess.run([str(BIN / "ptxas"), "-v", "--gpu-name=sm_90a", str(path), "-o", str(path) + ".o"],
                                capture_output=True, text=True, check=True).stderr
    return {"registers": int(re.search(r"Used (\d+) registers", report).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", report).group(1))}


def launch_row(name: str, cfg: splitk.SplitKConfig, rows: int, permuted: bool, act: str = "fp16") -> dict:
    kernel = compile_launch(cfg, rows, permuted, act)
    counts = opcodes(kernel.asm["cubin"])
    codes = cfg.block_k * cfg.k_steps * cfg.block_n // (32 * cfg.num_warps)  # one K span x column tile, per thread
    total = sum(counts.values())
    return {"launch": name, "config": cfg.name, "activations": act, "rows": rows, "act_order_gather": permuted,
            "instructions_per_thread": total, "codes_per_thread": codes,
            "instructions_per_code": round(total / codes, 2), **ptxas_usage(kernel.asm["ptx"]),
            "shared_bytes": kernel.metadata.shared, "top": dict(counts.most_common(12))}


def main() -> int:
    if not (BIN / "cuobjdump").exists():
        print("this triton wheel carries no cuobjdump", file=sys.stderr)
        return 3
    in_place = dataclasses.replace(splitk.ONE_ROW, in_place=True)
    half2 = dataclasses.replace(splitk.ONE_ROW, half2=True)
    half2_wide = dataclasses.replace(half2, block_n=1024)
    pairs = dataclasses.replace(splitk.ROWS, pairs=True)
    wide = [splitk.SplitKConfig(*c[:5], reduce="last", pairs=c[5], block_m=c[6])  # the bench's 17-64-row tiles
            for c in ((128, 32, 4, 4, 2, True, 64), (256, 32, 4, 8, 2, True, 64), (256, 32, 4, 4, 2, True, 32),
                      (128, 32, 4, 4, 2, False, 64))]
    launches = [("one_row_half2", half2, 1, True), ("one_row_half2", half2, 1, False),
                ("one_row_half2", half2_wide, 1, True), ("one_row_half2", half2_wide, 1, False),
                ("one_row_half2", half2_wide, 1, True, "bf16"), ("one_row_half2", half2_wide, 1, False, "bf16"),
                ("one_row", splitk.ONE_ROW, 1, True), ("one_row", splitk.ONE_ROW, 1, False),
                ("one_row_in_place", in_place, 1, True), ("one_row_in_place", in_place, 1, False),
                ("rows", splitk.ROWS, 16, True), ("rows", splitk.ROWS, 16, False),
                ("rows_pairs", pairs, 16, True), ("rows_pairs", pairs, 16, False),
                ("rows_pairs", pairs, 16, True, "bf16"), ("rows_pairs", pairs, 16, False, "bf16"),
                *((f"rows_wide_{cfg.name}", cfg, cfg.block_m, gather) for cfg in wide for gather in (True, False))]
    print(json.dumps([launch_row(*launch) for launch in launches], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
