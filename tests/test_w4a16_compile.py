"""The w4a16 Triton kernels compiled for an H100/H200 (sm_90) on this CPU host: Triton's own compiler and the ptxas it
ships, no GPU needed. The interpreter tests check the arithmetic; this checks what only the compiler sees (layouts of
the reshape and reductions, tl.dot shapes, shared memory, the serial reduction's scalar atomic taken by one thread
after a CTA barrier) for one launch of each code path, so a device run is not spent on a kernel that does not build.

The compile runs in a child process without TRITON_INTERPRET (conftest sets it for this one, and Triton decides at
import whether its decorators interpret).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

DECODE_ARGS = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "out_ptr", "lock_ptr", "M", "N", "K", "K_PER_SPLIT",
               "GROUP", "stride_xm", "stride_qk", "stride_sg", "stride_ys", "stride_ym")
CASES = (  # activation dtype, rows, bits, 16-bit dot, serial reduction
    ("fp16", 1, 4, True, True),    # the GEMV path
    ("bf16", 16, 8, True, False),  # tensor-core dot, 8-bit
    ("fp32", 64, 4, False, True),  # fp32 dot
)
SPLITK_CASES = (  # activation dtype, rows, bits, act-order gather, SplitKConfig fields (None: the rule's launch)
    ("fp16", 1, 4, True, None),  # one row: words loaded once, fields unpacked, the "last" reduction
    ("fp16", 16, 4, True, None),  # tl.dot
    ("bf16", 16, 8, False, None),
    ("fp16", 1, 4, True, {"reduce": "atomic"}),
    ("fp16", 1, 4, False, {"unpack": True, "block_k": 64, "num_warps": 4}),
    ("fp16", 1, 4, True, {"in_place": True, "block_n": 512}),
    ("bf16", 1, 8, False, {"in_place": True}),
    ("fp16", 1, 4, True, {"half2": True, "unpack": True, "block_n": 512}),  # ONE_ROW's tile, two codes an fp16x2 op
    ("fp16", 1, 4, True, {"half2": True, "unpack": True, "block_n": 1024}),  # 16 columns a thread
    ("fp16", 1, 4, False, {"half2": True, "unpack": True, "block_n": 1024}),
    ("fp16", 1, 4, False, {"half2": True, "unpack": True, "block_k": 16, "k_steps": 1}),  # one word per fp16 sum
    ("bf16", 1, 4, True, {"half2": True, "unpack": True, "block_n": 1024}),  # bf16 pairs converted to fp16 per row
    ("fp16", 16, 4, True, {"pairs": True, "k_steps": 4, "num_warps": 4, "num_stages": 2}),  # ROWS, codes in pairs
    ("bf16", 16, 4, False, {"pairs": True, "k_steps": 4, "num_warps": 4, "num_stages": 2}),
    ("bf16", 16, 8, True, {"pairs": True, "k_steps": 4, "num_warps": 4, "num_stages": 2}),  # 8 bits: _rows_dot
    # the bench's 64-row tile (17-64 rows), pairs and not
    ("fp16", 64, 4, True, {"pairs": True, "block_m": 64, "block_n": 128, "k_steps": 4, "num_warps": 4,
                           "num_stages": 2}),
    ("bf16", 64, 4, False, {"block_m": 64, "block_n": 128, "k_steps": 4, "num_warps": 4, "num_stages": 2}),
)
# The half2 variant's issue budget where a thread holds 16 columns (its per-row activation work shared by more
# codes): sm_90 instructions per 4-bit code, 2.70 without the act-order gather and 3.02 with it when written, bf16
# 2.87 and 3.14 (an H200 issues about 3.5 a code in the time copy bandwidth reads it; benchmarks/w4a16_sass.py). And
# its fp16x2 multiply-adds at every tile: one a code (a dequantizing one and a multiply-add a pair), where unpaired
# fp16 code takes two.
HALF2_MAX_PER_CODE = {"fp16": 3.2, "bf16": 3.4}
HALF2_FP16X2_PER_CODE = (1.0, 1.1)
# The pairs variant at ROWS's tile: 5.38 sm_90 instructions a code with the act-order gather and 4.91 without when
# written (ROWS without it: 10.0 and 9.5), 1.6 a code of them making the weights, half a 16-bit pair op each.
PAIRS_MAX_PER_CODE = 5.8
PAIRS_PAIR_OPS_PER_CODE = (0.5, 0.6)
FUSED_CASES = (  # activation dtype, scales dtype, FusedConfig fields (the bench's two tiles)
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("bf16", "fp16", {"block_m": 64, "num_warps": 4}),  # scales multiplied in fp32
)
GEMV_CASES = (  # activation dtype, rows, bits, act-order gather, serial reduction
    ("fp16", 1, 4, True, True),
    ("bf16", 4, 8, False, False),
    ("fp16", 16, 4, True, False),
)


def compile_all() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedserve.quant import w4a16_triton as wt

    target = GPUTarget("cuda", 90, 32)

    def build(kernel, signature, constants, num_warps=4, attrs=None):
        sig = {**signature, **{c: "constexpr" for c in constants}}
        return triton.compile(ASTSource(kernel, sig, constants, attrs), target=target,
                              options={"num_warps": num_warps})

    out = {}
    for x, rows, bits, dot16, serial in CASES:
        cfg = wt.launch_config(rows)
        types = [f"*{x}", "*i32", "*fp16", "*fp16", "*fp32" if serial else f"*{x}", f"*{x}", "*i32"] + ["i32"] * 10
        k = build(wt._decode_gemm_kernel, dict(zip(DECODE_ARGS, types)),
                  dict(BITS=bits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_16BIT=dot16,
                       SERIAL=serial), cfg.num_warps)
        ptx = k.asm["ptx"]
        out[f"{x}-{rows}-{bits}"] = {"shared": k.metadata.shared, "serial": serial,
                                     "one_thread_atomic": "@%p" in ptx.split("atom.global.gpu.acq_rel.add")[0][-40:]
                                     if serial else None, "cg_loads": "ld.global.cg" in ptx}
    from pagedserve.quant import w4a16_gemv as wg

    gemv_args = ("x_ptr", "perm_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "out_ptr", "lock_ptr", "M", "N", "K",
                 "K_PER_SPLIT", "GROUP", "stride_xm", "stride_qk", "stride_sg", "stride_ys")
    for x, rows, bits, permuted, serial in GEMV_CASES:
        types = [f"*{x}", "*i64", "*i32", "*fp16", "*fp16", "*fp32" if serial else f"*{x}", f"*{x}", "*i32"] + \
            ["i32"] * 9
        cfg = wg.DEFAULT
        k = build(wg._gemv_kernel, dict(zip(gemv_args, types)),
                  dict(BITS=bits, BLOCK_M=rows, BLOCK_N=cfg.block_n, BLOCK_KW=max(1, min(cfg.block_kw, 32 // rows)), PERMUTED=permuted,
                       SERIAL=serial), cfg.num_warps)
        ptx = k.asm["ptx"]
        out[f"gemv-{x}-{rows}-{bits}"] = {
            "shared": k.metadata.shared, "serial": serial, "cg_loads": "ld.global.cg" in ptx,
            "one_thread_atomic": "@%p" in ptx.split("atom.global.gpu.acq_rel.add")[0][-40:] if serial else None,
            "int_to_float": "cvt.rn.f32.s32" in ptx or "cvt.rn.f32.u32" in ptx}
    out.update(compile_splitk(build))
    out.update(compile_fused(build))
    build(wt._dequant_kernel, {"qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "w_ptr": "*bf16", "N": "i32",
                               "K": "i32", "GROUP": "i32", "stride_qk": "i32", "stride_sg": "i32", "stride_wk": "i32"},
          dict(BITS=4, BLOCK_N=64, BLOCK_K=64))
    build(wt._sum_splits_kernel, {"p_ptr": "*fp32", "y_ptr": "*fp16", "SPLITS": "i32", "SIZE": "i32"}, dict(BLOCK=1024))
    return out


def sass_counts(cubin: bytes) -> dict | None:
    """Opcode counts of the kernel's sm_90 machine code (benchmarks/w4a16_sass.py's count, with the cuobjdump of
    Triton's wheel), None without one."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # scripts, not a package
    from w4a16_sass import BIN, opcodes

    return dict(opcodes(cubin)) if (BIN / "cuobjdump").exists() else None


def compile_splitk(build) -> dict:
    import torch

    from pagedserve.quant import w4a16_splitk as sk

    args = ("x_ptr", "perm_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", "ws_ptr", "count_ptr", "M", "N", "K", "GROUP",
            "stride_xm", "stride_qk", "stride_sg", "magic")
    # As the runtime specializes them: pointers and 16-divisible ints (every stride and width but M) divisible by 16,
    # so that the counted code has the 16-byte loads a launch gets.
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(args) if name != "M"}
    out = {}
    for x, rows, bits, permuted, fields in SPLITK_CASES:
        cfg = sk.config_for(rows) if fields is None else sk.SplitKConfig(**fields)
        last = sk.sums_last(cfg, {"fp16": torch.float16, "bf16": torch.bfloat16}[x])
        types = [f"*{x}", "*i64", "*i32", "*fp16", "*fp16", f"*{x}", "*fp32", "*i32"] + ["i32"] * 8
        block_m = 1 if rows == 1 else cfg.block_m
        k = build(sk._splitk_kernel, dict(zip(args, types)),
                  dict(BITS=bits, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, K_STEPS=cfg.k_steps,
                       PERMUTED=permuted, DOT_16BIT=True, UNPACK=cfg.unpack, IN_PLACE=cfg.in_place,
                       HALF2=cfg.half2, PAIRS=cfg.pairs and bits == 4 and rows > 1, LAST=last),
                  cfg.num_warps, aligned if cfg.half2 or cfg.pairs else None)
        ptx = k.asm["ptx"]
        key = f"splitk-{cfg.name}-{x}-{rows}-{bits}-{'gather' if permuted else 'sorted'}"
        out[key] = {
            "shared": k.metadata.shared, "serial": False, "mma": "mma.sync" in ptx or "wgmma" in ptx,
            "one_thread_atomic": "@%p" in ptx.split("atom.global.gpu.acq_rel.add")[0][-40:] if last else None,
            "int_to_float": "cvt.rn.f32.s32" in ptx or "cvt.rn.f32.u32" in ptx, "block_m": block_m,
            "half2": cfg.half2, "f16x2": "fma.rn.f16x2" in ptx, "act": x,
            "pairs": cfg.pairs and bits == 4, "prmt": "prmt.b32" in ptx, "bf16x2": "fma.rn.bf16x2" in ptx}
        if cfg.half2 or out[key]["pairs"]:
            counts = sass_counts(k.asm["cubin"])
            codes = cfg.block_k * cfg.k_steps * cfg.block_n // (32 * cfg.num_warps)  # per thread
            out[key].update(
                sass_per_code=None if counts is None else sum(counts.values()) / codes,
                fp16x2_per_code=None if counts is None else (counts.get("HFMA2", 0) + counts.get("HMUL2", 0)) / codes,
                pair_ops_per_code=None if counts is None else (counts.get("HFMA2", 0) + counts.get("HADD2", 0)) / codes,
                wide=cfg.block_n // (32 * cfg.num_warps) >= 16 and cfg.k_steps >= 2)
    return out


def compile_fused(build) -> dict:
    from pagedserve.quant import w4a16_fused as wf

    args = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", "M", "N", "K", "GROUP", "stride_xm", "stride_qk",
            "stride_sg", "stride_om")
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(args) if name != "M"}
    out = {}
    for x, scales, fields in FUSED_CASES:
        cfg = wf.FusedConfig(**fields)
        types = [f"*{x}", "*i32", f"*{scales}", f"*{scales}", f"*{x}"] + ["i32"] * 8
        k = build(wf._fused_kernel, dict(zip(args, types)), dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                                                 BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m),
                  cfg.num_warps, aligned)
        ptx = k.asm["ptx"]
        out[f"fused-{cfg.name}-{x}-{scales}"] = {
            "shared": k.metadata.shared, "serial": False, "fused": True, "prmt": "prmt.b32" in ptx,
            "tensor_cores": "wgmma" in ptx or "mma.sync" in ptx, "int_to_float": "cvt.rn.f32.s32" in ptx}
    return out


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-P", str(Path(__file__).resolve())], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(CASES) + len(GEMV_CASES) + len(SPLITK_CASES) + len(FUSED_CASES)
    for name, r in results.items():
        if name.startswith(("gemv", "splitk")):  # codes become floats through the 2^23 mantissa trick
            assert not r["int_to_float"], name
        if name.startswith("splitk"):  # 16-64 rows on the tensor cores (64: the warpgroup MMA, wgmma, on sm_90)
            assert r["mma"] == (r["block_m"] > 1), name
            assert r["one_thread_atomic"] in (None, True), name
        if r.get("half2"):  # two codes an fp16x2 instruction, within the issue budget where the tile is wide
            assert r["f16x2"], name
            lo, hi = HALF2_FP16X2_PER_CODE
            assert r["sass_per_code"] is None or lo <= r["fp16x2_per_code"] <= hi, (name, r)
            bound = HALF2_MAX_PER_CODE[r["act"]]
            assert r["sass_per_code"] is None or not r["wide"] or r["sass_per_code"] < bound, (name, r)
        if r.get("fused"):  # weights made in pairs, multiplied on the tensor cores, no int-to-float conversion
            assert r["prmt"] and r["tensor_cores"] and not r["int_to_float"], name
        if r.get("pairs"):  # codes made 16-bit weights by permute, logic op and one pair op per two codes
            assert r["prmt"] and r[{"fp16": "f16x2", "bf16": "bf16x2"}[r["act"]]], name
            lo, hi = PAIRS_PAIR_OPS_PER_CODE
            assert r["sass_per_code"] is None or lo <= r["pair_ops_per_code"] <= hi, (name, r)
            # a wider tile multiplies each weight into more rows: its budget is per code and 16 rows (sm_90 at the
            # 64-row tile, 128 columns: 13.4 a code with the gather, 9.7 without, where 4 ROWS launches take 40)
            per_16_rows = r["sass_per_code"] * 16 / r["block_m"] if r["sass_per_code"] is not None else None
            assert per_16_rows is None or per_16_rows < PAIRS_MAX_PER_CODE, (name, r)
        assert r["shared"] <= 227 * 1024, name  # an H100's shared memory per block
        if r["serial"]:  # one thread takes the ticket and reads the partials through L2
            assert r["one_thread_atomic"] and r["cg_loads"], name


if __name__ == "__main__":
    try:
        print(json.dumps(compile_all()))
    except FileNotFoundError as exc:  # a triton without its bundled ptxas
        print(f"cannot compile for sm_90 here: {exc}")
        sys.exit(3)
