"""The split-K GEMV's `pairs` rows variant (quant/w4a16_pairs.py: 4-bit codes made 16-bit weights two at a time for
tl.dot) against the dequantized fp32 reference under Triton's interpreter, and its PTX run instruction by instruction
by a small emulator of the five PTX instructions it uses (the interpreter cannot run PTX; tests/test_w4a16_compile.py
checks the machine code it becomes, tests/gpu/test_w4a16_gpu.py runs it on a device through the bench sweep).
"""

from __future__ import annotations

import re

import pytest
import torch

from quant_fixtures import random_weight

from test_w4a16 import DEVICE, TOLERANCE, _on

w4a16_kernel = pytest.importorskip("pagedserve.quant.w4a16_kernel", reason="triton is not installed")


@pytest.mark.parametrize("bits,k,n,group,act_order", [
    (4, 320, 72, 64, True), (4, 200, 40, -1, False), (4, 208, 96, 48, True), (8, 208, 96, 32, True),
    (4, 1024, 24, 128, False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_splitk_pairs_matches_reference(bits, k, n, group, act_order, dtype):
    """2-16 rows with the codes made weights two at a time: act-order, partial and odd groups (48: 16-row spans, two
    words a step), one group, N under one tile; 8 bits and fp32 take `_rows_dot`. The weights are exact integers, so
    the only error is the activation's 16-bit rounding and the fp32 sums: within the tolerance of the other paths."""
    from pagedserve.quant import w4a16_splitk

    w = random_weight(k, n, bits, group, act_order, seed=k + n + bits)
    kernel = w4a16_kernel.W4A16Kernel(_on(w, DEVICE))
    dense = w.dequantize(torch.float32)
    for m in (2, 7, 16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        ref = x.float() @ dense.t()
        for block_n in (32, 64):
            cfg = w4a16_splitk.SplitKConfig(block_n=block_n, k_steps=4, num_warps=4, pairs=True)
            y = kernel.splitk(x.to(DEVICE), cfg).float().cpu()
            err = (y - ref).abs().max().item()
            assert err <= TOLERANCE[dtype] * ref.abs().max().item(), (m, block_n, err)
    assert not kernel.workspace().sums.any() and not kernel.workspace().counts.any()


@pytest.mark.parametrize("bits,k,n,group,act_order", [(4, 320, 72, 64, True), (8, 208, 40, -1, False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_splitk_wide_tiles_match_reference(bits, k, n, group, act_order, dtype):
    """The 32- and 64-row tiles (the bench's 17-64-row band), with and without pairs, through the one workspace
    sized for the widest: the reference within the other paths' tolerance, the workspace zero after; more rows than
    the tile, or another tile height, refused by name."""
    from pagedserve.quant import w4a16_splitk

    w = random_weight(k, n, bits, group, act_order, seed=k + n + bits + 1)
    kernel = w4a16_kernel.W4A16Kernel(_on(w, DEVICE))
    dense = w.dequantize(torch.float32)
    for m, block_m in ((17, 32), (32, 32), (40, 64), (64, 64)):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        ref = x.float() @ dense.t()
        for pairs in (True, False):
            cfg = w4a16_splitk.SplitKConfig(block_n=32, k_steps=4, num_warps=4, pairs=pairs, block_m=block_m)
            y = kernel.splitk(x.to(DEVICE), cfg).float().cpu()
            err = (y - ref).abs().max().item()
            assert err <= TOLERANCE[dtype] * ref.abs().max().item(), (m, block_m, pairs, err)
    assert not kernel.workspace().sums.any() and not kernel.workspace().counts.any()
    with pytest.raises(ValueError, match="1..32 rows"):
        kernel.splitk(torch.zeros(33, k, dtype=dtype).to(DEVICE), w4a16_splitk.SplitKConfig(block_m=32))
    with pytest.raises(ValueError, match="block_m"):
        w4a16_splitk.SplitKConfig(block_m=48)
    assert w4a16_splitk.SplitKConfig(pairs=True, block_m=64).name.endswith("_pairs_m64")


def test_pairs_is_taken_for_16bit_activations_and_4bit_codes_only():
    from pagedserve.quant.w4a16_pairs import pairs_takes
    from pagedserve.quant.w4a16_splitk import SplitKConfig

    x = torch.zeros(4, 64)
    assert pairs_takes(x.half(), 4) and pairs_takes(x.bfloat16(), 4)
    assert not pairs_takes(x, 4) and not pairs_takes(x.half(), 8)
    assert SplitKConfig(pairs=True).name.endswith("_pairs")


def _f16x2(bits: int, dtype: torch.dtype) -> torch.Tensor:
    halves = torch.tensor([bits & 0xFFFF, bits >> 16], dtype=torch.int32).to(torch.int16)
    return halves.view(dtype).double()


def _pack(values: torch.Tensor, dtype: torch.dtype) -> int:
    lo, hi = (int(h) & 0xFFFF for h in values.to(dtype).view(torch.int16))
    return lo | hi << 16


def _run_ptx(ptx: str, regs: dict[str, int], dtype: torch.dtype) -> dict[str, float]:
    """Executes the PTX's shr, prmt, lop3, fma.rn.{f16x2,bf16x2} and mov.b32 (a value, or {lo, hi}) on 32-bit
    integers."""
    out: dict[str, float] = {}

    def val(tok: str) -> int:
        return int(tok, 0) if tok[0].isdigit() else regs[tok]

    for line in ptx.splitlines():
        op, _, rest = line.strip().rstrip(";").partition(" ")
        args = [a.strip() for a in rest.split(",")] if rest else []
        if op == "shr.u32":
            regs[args[0]] = val(args[1]) >> val(args[2])
        elif op == "prmt.b32":
            pool = (val(args[1]) | val(args[2]) << 32).to_bytes(8, "little")
            sel = val(args[3])
            regs[args[0]] = int.from_bytes(bytes(pool[(sel >> 4 * j) & 7] for j in range(4)), "little")
        elif op == "lop3.b32":
            assert args[4] == "0xEA", "the emulator knows (a & b) | c only"
            regs[args[0]] = (val(args[1]) & val(args[2])) | val(args[3])
        elif op.startswith("fma.rn."):
            a, b, c = (_f16x2(val(t), dtype) for t in args[1:4])
            regs[args[0]] = _pack(a * b + c, dtype)  # exact operands: the one rounding is the cast
        elif op == "mov.b32" and not rest.startswith("{"):
            regs[args[0]] = val(args[1])
        elif op == "mov.b32":
            lo, hi = re.match(r"\{(\$\d+), (\$\d+)\}", rest).groups()
            pair = _f16x2(regs[args[-1]], dtype)
            out[lo], out[hi] = float(pair[0]), float(pair[1])
        else:
            assert op in ("{", "}", ".reg"), f"unknown PTX op {op!r}"
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pairs_ptx_yields_the_eight_codes_minus_zero_in_k_order(dtype):
    """The PTX of w4a16_pairs, executed: $0..$7 are codes 0..7 of the word minus z, for random words, every zero
    point, and the words with every nibble 0 or 15."""
    from pagedserve.quant import w4a16_pairs

    bf16 = dtype == torch.bfloat16
    ptx = w4a16_pairs._pairs_ptx(bf16)
    base = w4a16_pairs.BF16_MAGIC if bf16 else w4a16_pairs.FP16_MAGIC
    words = torch.randint(0, 1 << 32, (64,), generator=torch.Generator().manual_seed(5), dtype=torch.int64).tolist()
    for z in range(16):
        for word in words + [0, 0xFFFFFFFF, 0x76543210, 0xF0F0F0F0]:
            regs = {"$8": word, "$9": _pack(torch.tensor([base, base]), dtype),
                    "$10": _pack(torch.tensor([-(base + z)] * 2), dtype)}
            got = _run_ptx(ptx, regs, dtype)
            assert [got[f"${j}"] for j in range(8)] == [((word >> 4 * j) & 15) - z for j in range(8)], (hex(word), z)


@pytest.mark.parametrize("bits,k,n,group,act_order", [
    (4, 320, 72, 64, True), (4, 208, 96, 48, True), (4, 200, 40, -1, False), (8, 208, 96, 32, True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fused_gemm_matches_reference_and_the_dense_path(bits, k, n, group, act_order, dtype):
    """The fused prefill GEMM (quant/w4a16_fused.py: weights made in pairs and scaled inside the GEMM) over row tiles
    and column tiles with ragged edges, act-order (permuted once by the caller), partial, odd (48) and single groups:
    the dequantized reference within the tolerance, and, its weights being the values `dequantize_t` stores, the
    dense path's result within the output's own rounding (fp32 sums in another order can round to the neighbouring
    16-bit value). 8 bits and fp32 are given the dense path."""
    from pagedserve.quant import w4a16_fused

    w = random_weight(k, n, bits, group, act_order, seed=k + n)
    kernel = w4a16_kernel.W4A16Kernel(_on(w, DEVICE))
    dense = w.dequantize(torch.float32)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    ref = x.float() @ dense.t()
    y = kernel(x.to(DEVICE), force="fused").float().cpu()
    assert (y - ref).abs().max().item() <= TOLERANCE[dtype] * ref.abs().max().item()
    if w4a16_fused.fused_takes(x, bits):
        small = w4a16_fused.FusedConfig(block_m=16, block_n=32, block_k=64, num_warps=4, group_m=2)
        xs = x.to(DEVICE) if kernel.perm is None else x.to(DEVICE).index_select(1, kernel.perm)
        y_small = w4a16_fused.fused_gemm(xs, kernel.layout(), small).float().cpu()
        y_dense = kernel(x.to(DEVICE), force="dense").float().cpu()
        ulp = 2 * torch.finfo(dtype).eps * ref.abs().max().item()
        assert (y_small - y_dense).abs().max().item() <= ulp
        assert (y - y_dense).abs().max().item() <= ulp


def test_fused_gemm_refuses_what_it_does_not_take():
    from pagedserve.quant import w4a16_fused, w4a16_layout

    layout = w4a16_layout.repack(random_weight(64, 16, 8, -1, False))
    with pytest.raises(ValueError, match="4-bit"):
        w4a16_fused.fused_gemm(torch.zeros(2, 64, dtype=torch.float16), layout)
    with pytest.raises(ValueError, match="powers of two"):
        w4a16_fused.FusedConfig(block_m=48)
