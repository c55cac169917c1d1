"""Build the Triton decode kernels and the layer ops for sm_90 on a host without a GPU; print ptxas's use as JSON.

    python tests/triton_sm90_build.py      # in a process where TRITON_INTERPRET is unset

Triton lowers to PTX without a driver and its wheel carries ptxas, so the compiler's own errors (constructs the
interpreter accepts and the GPU compiler does not) and the register budget the launch relies on are checked here,
before any device time is spent. Prints {case: {"registers": int, "spill_bytes": int, "shared": int}}.
"""

from __future__ import annotations

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
from pagedserve.kernels import triton_decode_reduce as reduce
from pagedserve.kernels import triton_layer_ops as layer_ops
from pagedserve.kernels.triton_attention import _num_stages

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
_TL = {"fp16": tl.float16, "bf16": tl.bfloat16}
_FLOATS = {"qk_scale_log2", "eps"}


def _signature(fn, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Every argument: constexpr, the pointer type given (fp32 workspaces and scales otherwise), or a 32-bit int."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "fp32")
        else:
            sig[name] = "fp32" if name in _FLOATS else "i32"
    return {k: ("*" + v if k.endswith("_ptr") else v) for k, v in sig.items()}


def build(fn, pointers: dict[str, str], constexprs: dict, num_warps: int, num_stages: int, maxnreg: int | None) -> dict:
    sig = _signature(fn, pointers, constexprs)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        report = subprocess.run([str(PTXAS), "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                                capture_output=True, text=True, check=True).stderr
    return {"registers": int(re.search(r"Used (\d+) registers", report).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", report).group(1)),
            "shared": kernel.metadata.shared}


def decode_case(query: str, cache: str, queries_per_kv: int, head_dim: int, split: bool) -> dict:
    """The launch triton_decode_attention makes for these dtypes, with the default tile, warps and (no) prefetch."""
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    itemsize = 1 if cache in ("fp8e4nv", "fp8e5", "i8") else 2
    tile = decode.decode_tile(head_dim_pad, 2, cache.startswith("fp8"))
    warps = decode.decode_warps(tile, head_dim_pad, itemsize, cache.startswith("fp8"))
    constexprs = dict(
        NUM_QUERIES_PER_KV=queries_per_kv, BLOCK_M=max(16, triton.next_power_of_2(queries_per_kv)), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=16, TILE_N=tile, SPLIT=split, PREFETCH=False,
        IS_FP8=cache.startswith("fp8"), IS_INT8=cache == "i8", DOT_PRECISION="tf32", DOT_DTYPE=_TL[query],
        WORDS="", WORDS_PTX=True, KEYS_MAJOR=False)
    pointers = {"out_ptr": query, "q_ptr": query, "k_cache_ptr": cache, "v_cache_ptr": cache,
                "k_row_scale_ptr": "fp16", "v_row_scale_ptr": "fp16", "block_tables_ptr": "i32",
                "seq_lens_ptr": "i32", "query_start_loc_ptr": "i32"}
    return build(decode._decode_kernel, pointers, constexprs, warps, _num_stages(tile, head_dim_pad, itemsize),
                 decode._MAX_REGISTERS if warps == 8 else None)


def main() -> int:
    result = {
        "decode_fp16_split": decode_case("fp16", "fp16", 4, 128, True),
        "decode_bf16_int8_split": decode_case("bf16", "i8", 4, 128, True),
        "decode_fp16_fp8_single": decode_case("fp16", "fp8e4nv", 8, 128, False),
        "reduce": build(reduce.reduce_kernel, {"out_ptr": "fp16", "seq_lens_ptr": "i32", "query_start_loc_ptr": "i32"},
                        dict(HEAD_DIM=128, HEAD_DIM_PAD=128, TILE_N=32), 4, 1, None),
        # The layer ops at Llama-3-8B widths (hidden 4096, intermediate 14336, head dim 128), as launched.
        "add_rms_norm_bf16": build(layer_ops._rms_norm_kernel, {n: "bf16" for n in ("x_ptr", "delta_ptr", "w_ptr",
                                   "out_ptr")}, dict(ADD=True, BLOCK=4096), layer_ops._warps(4096), 1, None),
        "silu_and_mul_fp16": build(layer_ops._silu_and_mul_kernel, {"gate_up_ptr": "fp16", "out_ptr": "fp16"},
                                   dict(BLOCK=2048), layer_ops._warps(2048), 1, None),
        "rope_fp16": build(layer_ops._rope_kernel, {n: "fp16" for n in ("x_ptr", "cos_ptr", "sin_ptr", "out_ptr")},
                           dict(DIM=128, BLOCK=128), 1, 1, None),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
