"""Whether the 16-row split-K GEMV's dequantized weights can reach the tensor cores without a shared-memory trip:
sm_90 machine code of three arrangements of one K span, counted on a host without a GPU (as w4a16_sass.py does).

    python benchmarks/w4a16_operand_sass.py        # TRITON_INTERPRET unset; needs the wheel's ptxas/cuobjdump

All three make each word's 8 codes fp16 (q - z) pairs with w4a16_pairs.py's PTX, at ROWS's tile (256 columns, a
128-row K span, 4 warps, 2 stages), and add their fp32 partial sums into a workspace:
- `as_is`: the kernel's own order, tl.dot(x [16, K], w [K, N]) after the codes' join and reshape, 32 rows a load;
- `weight_first`: tl.dot(w^T [N, K], x^T [K, 16]): Hopper's warpgroup MMA takes its first operand from registers;
- `per_code`: one tl.dot per code position j of a word (x's columns 8r + j against code j of 16 words): elementwise
  from the loaded words to the operand, no join or reshape for Triton's layout pass to see through.
Prints JSON per arrangement and gather: instructions per 4-bit code, shared-memory stores (STS) and matrix loads
(LDSM) per code, registers, spills, shared bytes, the MMA instruction. Counts are not speeds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

import w4a16_sass as sass  # noqa: E402
from pagedserve.quant.w4a16_pairs import _CONSTRAINTS, _PTX_F16, _pair_bits, _word_codes  # noqa: E402

ARRANGEMENTS = ("as_is", "weight_first", "per_code")


@triton.jit
def _x_columns(x_ptr, perm_ptr, offs_m, m_ok, k, k_ok, stride_xm, PERMUTED: tl.constexpr, ROWS_MAJOR: tl.constexpr):
    src = tl.load(perm_ptr + k, mask=k_ok, other=0) if PERMUTED else k
    if ROWS_MAJOR:
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + src[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    else:
        x = tl.load(x_ptr + offs_m[None, :] * stride_xm + src[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
    return x


@triton.jit
def _span_kernel(x_ptr, perm_ptr, qw_ptr, z_ptr, ws_ptr, M, N, K, stride_xm, stride_qk, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, PERMUTED: tl.constexpr,
                 ARRANGEMENT: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_first = pid_k * (BLOCK_K * K_STEPS)
    z = tl.load(z_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    magic = _pair_bits(tl.full((1, 1), 1024.0, tl.float32), False)
    neg_bias = _pair_bits(-(1024.0 + z), False)
    KW: tl.constexpr = BLOCK_K // 8
    offs_w = tl.arange(0, KW)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    acc = tl.zeros((BLOCK_N, BLOCK_M) if ARRANGEMENT == "weight_first" else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in tl.static_range(K_STEPS):
        rows = k_first // 8 + step * KW + offs_w
        words = tl.load(qw_ptr + rows.to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                        mask=(rows < K // 8)[:, None] & n_ok[None, :], other=0, eviction_policy="evict_first")
        if ARRANGEMENT == "per_code":
            codes = tl.inline_asm_elementwise(_PTX_F16, _CONSTRAINTS, [words, magic, neg_bias],
                                              dtype=(tl.float16,) * 8, is_pure=True, pack=1)
            k = rows * 8
            for j in tl.static_range(8):
                x = _x_columns(x_ptr, perm_ptr, offs_m, m_ok, k + j, k < K, stride_xm, PERMUTED, True)
                acc += tl.dot(x, codes[j])
        else:
            codes = tl.reshape(_word_codes(words, magic, neg_bias, z, False), (KW, BLOCK_N, 8))
            k = k_first + step * BLOCK_K + tl.arange(0, BLOCK_K)
            if ARRANGEMENT == "weight_first":
                w_t = tl.reshape(tl.permute(codes, (1, 0, 2)), (BLOCK_N, BLOCK_K))
                acc += tl.dot(w_t, _x_columns(x_ptr, perm_ptr, offs_m, m_ok, k, k < K, stride_xm, PERMUTED, False))
            else:
                w = tl.reshape(tl.permute(codes, (0, 2, 1)), (BLOCK_K, BLOCK_N))
                acc += tl.dot(_x_columns(x_ptr, perm_ptr, offs_m, m_ok, k, k < K, stride_xm, PERMUTED, True), w)
    if ARRANGEMENT == "weight_first":
        tile, tile_ok = offs_m[None, :] * N + offs_n[:, None], n_ok[:, None] & m_ok[None, :]
    else:
        tile, tile_ok = offs_m[:, None] * N + offs_n[None, :], m_ok[:, None] & n_ok[None, :]
    tl.atomic_add(ws_ptr + tile, acc, mask=tile_ok, sem="relaxed", scope="gpu")


def arrangement_row(arrangement: str, permuted: bool, block_m: int = 16, block_n: int = 256, num_warps: int = 4,
                    num_stages: int = 2) -> dict:
    # The same 128-row span: 32-row loads 4 times, or (per_code: a dot needs 16 words' depth) one 128-row load.
    block_k, k_steps = (128, 1) if arrangement == "per_code" else (32, 4)
    args = ("x_ptr", "perm_ptr", "qw_ptr", "z_ptr", "ws_ptr", "M", "N", "K", "stride_xm", "stride_qk")
    types = ("*fp16", "*i64", "*i32", "*fp16", "*fp32") + ("i32",) * 5
    constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_STEPS=k_steps, PERMUTED=permuted,
                     ARRANGEMENT=arrangement)
    kernel = sass.compile_sm90(_span_kernel, args, types, constants, num_warps, num_stages)
    counts = sass.opcodes(kernel.asm["cubin"])
    codes = block_k * k_steps * block_n // (32 * num_warps)
    mma = next((line.strip().split()[0] for line in kernel.asm["ptx"].splitlines()
                if "mma.sync" in line or "wgmma.mma_async" in line), None)
    return {"arrangement": arrangement, "act_order_gather": permuted, "codes_per_thread": codes,
            "instructions_per_code": round(sum(counts.values()) / codes, 2),
            "shared_stores_per_code": round(counts["STS"] / codes, 3),
            "matrix_loads_per_code": round(counts["LDSM"] / codes, 3), **sass.ptxas_usage(kernel.asm["ptx"]),
            "shared_bytes": kernel.metadata.shared, "mma": mma}


def main() -> int:
    if not (sass.BIN / "cuobjdump").exists():
        print("this triton wheel carries no cuobjdump", file=sys.stderr)
        return 3
    print(json.dumps([arrangement_row(a, gather) for a in ARRANGEMENTS for gather in (True, False)], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
