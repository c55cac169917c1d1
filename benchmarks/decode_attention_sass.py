"""The decode-attention kernel's machine code for an H100/H200, counted on a host without a GPU: lane-instructions
per KV-cache byte in the kernel's tile loop, per cache dtype and launch setting.

    python benchmarks/decode_attention_sass.py [fp16 fp8 int8 words]   # TRITON_INTERPRET unset; ptxas/cuobjdump
                                            # from Triton's wheel; names: only their default launch (words: word tiles)

A decode kernel reads each KV byte once, so what it may spend per byte is bounded: an H200 issues about 30 T
lane-instructions a second against ~4.2 TB/s of copy bandwidth (~7 a byte), and far less where shared-memory loads
queue behind each other. The 2026-11-30 H200 runs measured fp16 at 0.96 of copy bandwidth, FP8 at 0.54 and int8 at
0.33; this prints why before any device time: the loop's static instruction count (the body between the tile
loop's label and its backward branch, executed once per tile by every thread) times the threads, over the KV bytes a
tile brings, with the most frequent opcodes, ptxas's registers and spills, the shared memory, and the loop's
one-byte shared-memory reads. The launch is compiled as the runtime specializes it (pointers and the 16-divisible
strides marked divisible by 16), for a Llama-3-8B-shaped layer (head dim 128, 4 query heads per KV head, 16-token
blocks), split path; the 8-bit caches also with word tiles (`word_tiles`, kernels/triton_decode_words.py) and
keys along the MMA's M (`keys_major`, kernels/triton_decode_keys_major.py).
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedserve.kernels import triton_decode_attention as decode
from pagedserve.kernels.triton_attention import _num_stages

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
HEAD_DIM, QUERIES_PER_KV, BLOCK_SIZE = 128, 4, 16
# Strides the runtime sees as multiples of 16 at these shapes (cache [blocks, 16, Hkv, 128], query [T, H, 128]).
DIVISIBLE = {"stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_c_block", "stride_c_pos",
             "stride_c_head"}
CACHES = {"fp16": ("fp16", 2), "fp8": ("fp8e4nv", 1), "e5m2": ("fp8e5", 1), "int8": ("i8", 1)}
WORD_FORMATS = {"fp8": "e4m3", "e5m2": "e5m2", "int8": "int8"}
# (cache, tile tokens, warps, stages or None for the rule's, word tiles, keys major): each dtype's default, and the
# candidates the device check's sweep times (tests/gpu/bench_decode.py); word tiles: kernels/triton_decode_words.py,
# keys major: kernels/triton_decode_keys_major.py.
LAUNCHES = (("fp16", None, None, None, False, False), ("fp16", 64, 4, 1, False, False),
            ("fp8", None, None, None, False, False), ("fp8", 128, 4, 1, False, False), ("fp8", 64, 4, 1, False, False),
            ("fp8", 128, 8, None, False, False), ("fp8", 128, 4, 1, True, False), ("fp8", 128, 4, None, True, False),
            ("fp8", 128, 4, 1, True, True), ("fp8", 128, 4, None, True, True), ("fp8", 64, 4, 1, True, True),
            ("fp8", 128, 4, 1, False, True),
            ("e5m2", 128, 4, 1, True, True),
            ("int8", None, None, None, False, False), ("int8", 64, 8, 1, False, False),
            ("int8", 128, 4, 1, False, False), ("int8", 64, 4, None, False, False), ("int8", 128, 4, 1, True, False),
            ("int8", 64, 8, 1, True, False), ("int8", 128, 4, 1, True, True), ("int8", 128, 4, None, True, True),
            ("int8", 64, 4, 1, True, True))
DEFAULT = (None, None, None, False, False)


def _signature(cache: str) -> tuple[dict, dict]:
    fn = decode._decode_kernel
    pointers = {"out_ptr": "fp16", "q_ptr": "fp16", "k_cache_ptr": cache, "v_cache_ptr": cache,
                "k_row_scale_ptr": "fp16", "v_row_scale_ptr": "fp16", "block_tables_ptr": "i32",
                "seq_lens_ptr": "i32", "query_start_loc_ptr": "i32"}
    sig = {}
    for name in fn.arg_names:
        if name.endswith("_ptr"):
            sig[name] = "*" + pointers.get(name, "fp32")
        else:
            sig[name] = "fp32" if name == "qk_scale_log2" else "i32"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or n in DIVISIBLE}
    return sig, attrs


def compile_launch(dtype: str, tile: int | None, warps: int | None, stages: int | None, words: bool = False,
                   keys_major: bool = False):
    cache, itemsize = CACHES[dtype]
    fp8 = dtype in ("fp8", "e5m2")
    tile = tile or decode.decode_tile(HEAD_DIM, 2, fp8)
    warps = warps or decode.decode_warps(tile, HEAD_DIM, itemsize, fp8)
    stages = stages or _num_stages(tile, HEAD_DIM, itemsize)
    constants = dict(NUM_QUERIES_PER_KV=QUERIES_PER_KV, BLOCK_M=8 if keys_major else 16, HEAD_DIM=HEAD_DIM,
                     HEAD_DIM_PAD=HEAD_DIM,
                     BLOCK_SIZE=BLOCK_SIZE, TILE_N=tile, SPLIT=True, PREFETCH=False, IS_FP8=fp8,
                     IS_INT8=dtype == "int8", DOT_PRECISION="tf32", DOT_DTYPE=tl.float16,
                     WORDS=WORD_FORMATS[dtype] if words else "", WORDS_PTX=True, KEYS_MAJOR=keys_major)
    sig, attrs = _signature(cache)
    sig.update({name: "constexpr" for name in constants})
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": decode._MAX_REGISTERS} if warps == 8 else {})}
    kernel = triton.compile(ASTSource(decode._decode_kernel, sig, constants, attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    return kernel, tile, warps, stages


def _tool(name: str, *args: str, stderr: bool = False) -> str:
    done = subprocess.run([str(BIN / name), *args], capture_output=True, text=True, check=True)
    return done.stderr if stderr else done.stdout


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes between the innermost backward branch's target and the branch: the tile loop's body."""
    lines = [(int(m.group(1), 16), m.group(2), m.group(3))
             for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", sass)]
    loops = [(int(t.group(1), 16), addr) for addr, op, rest in lines if op.startswith("BRA")
             for t in [re.search(r"0x([0-9a-f]+)", rest)] if t and int(t.group(1), 16) < addr]
    if not loops:
        return collections.Counter()
    start, end = min(loops, key=lambda span: span[1] - span[0])
    return collections.Counter(op for addr, op, _ in lines if start <= addr <= end)


def launch_row(dtype: str, tile: int | None, warps: int | None, stages: int | None, words: bool = False,
               keys_major: bool = False) -> dict:
    kernel, tile, warps, stages = compile_launch(dtype, tile, warps, stages, words, keys_major)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(kernel.asm["ptx"])
        report = _tool("ptxas", "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(cubin), stderr=True)
        body = loop_opcodes(_tool("cuobjdump", "-sass", str(cubin)))
    kv_bytes = 2 * tile * HEAD_DIM * CACHES[dtype][1]  # K and V of one tile, one KV head
    lane_instructions = sum(body.values()) * warps * 32
    return {"cache": dtype, "tile": tile, "warps": warps, "stages": stages, "word_tiles": words,
            "keys_major": keys_major,
            "loop_instructions_per_thread": sum(body.values()),
            "lane_instructions_per_kv_byte": round(lane_instructions / kv_bytes, 2),
            "registers": int(re.search(r"Used (\d+) registers", report).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", report).group(1)),
            "shared_bytes": kernel.metadata.shared,
            "byte_loads": body["LDS.U8"] + body["LDS.S8"],  # the loop's shared-memory reads of one byte
            "wide_stores": body["STS.128"],  # and its 128-bit shared-memory stores
            "warpgroup_mmas": sum(n for op, n in body.items() if op.startswith("HGMMA")),  # Hopper's wgmma
            "top_opcodes": dict(body.most_common(8))}


def main() -> int:
    only = set(sys.argv[1:])  # cache names: their default launches, "words": the word-tile ones (tests); none: all
    launches = [launch for launch in LAUNCHES if launch[0] in only and launch[1:] == DEFAULT
                or "words" in only and launch[4]] if only else LAUNCHES
    rows = [launch_row(*launch) for launch in launches]
    for row in rows:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
