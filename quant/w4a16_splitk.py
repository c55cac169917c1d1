"""A wide split-K GEMV over the decode layout (w4a16_layout.py): every program reads one short K span of one column
tile, once, and adds its partial sum into the output.

The looped GEMV (w4a16_gemv.py) and the split-K tile kernel (w4a16_triton.py) read packed weights at 4-18% of copy
bandwidth on an H200 (docs/gpu.md): each program walks a long K range with few loads in flight. Here a grid of
(column tiles x K spans) programs, thousands at decode widths, each issues its whole K span's loads at once and
exits, so the SMs keep many independent loads in flight (gemlite's reversed split-K GEMV works the same way):
- one row reads its words in one of two ways (`unpack`): a [BLOCK_K, BLOCK_N] code tile whose word addresses repeat
  for the pf codes each holds (the repeats hit L1; no cross-thread unpacking), or each word once, its codes taken
  field by field into a [words, BLOCK_N] accumulator;
- a code becomes a float without a conversion instruction: OR-ing it into the mantissa of 2^23 gives 2^23 + q
  exactly, and subtracting 2^23 + z (one per column) leaves q - z: the zero point costs nothing per weight;
- one K span lies inside one group, so the scale multiplies the span's sum once;
- one row multiplies and sums on the CUDA cores in fp32 (`half2`: fp16x2, two codes an instruction, w4a16_half2.py);
  more rows pad to 16 (or to a 32- or 64-row tile, `block_m`: one launch reading the weights once for 17-64 rows, a
  bench candidate) and go through tl.dot with the integer weights exact in the activation's 16-bit type (`pairs`:
  made two at a time by Marlin's trick, w4a16_pairs.py);
- act-order's permutation is a gather of the activation inside the kernel.
Partial sums meet in one of two ways (`reduce`): "atomic" adds them into the zeroed output in its own type, fp16
or fp32 (as exllama's GPTQ kernels do; the summation order varies between runs; bf16 takes "last"), "last" adds
them into an fp32 workspace and the last program of each column tile (a counter per tile) writes the output and
leaves workspace and counter zero for the next call, in one launch; one workspace per device serves every layer.
The grid depends on M, N, K only, so CUDA graphs capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.quant.w4a16_half2 import FP16_PAIR_MAGIC, _one_row_half2, half2_takes
from pagedserve.quant.w4a16_layout import DecodeLayout
from pagedserve.quant.w4a16_one_row import _codes_minus_zero, _one_row_in_place, _one_row_repeated, _one_row_unpacked
from pagedserve.quant.w4a16_pairs import _rows_pairs, pairs_takes
from pagedserve.quant.w4a16_rule import SPLITK_MAX_ROWS as MAX_ROWS  # the default tl.dot tile's rows
from pagedserve.quant.w4a16_rule import SPLITK_WIDEST_ROWS as WIDEST_ROWS
from pagedserve.quant.w4a16_triton import INTERPRETED

REDUCES = ("atomic", "last")
# 2^23's bits, passed as a kernel argument rather than a literal: in a register, the field's AND and this OR become
# one 3-input logic instruction (with two literals ptxas emits two: 4.9 against 5.8 instructions a code, sm_90).
MANTISSA_MAGIC = 0x4B000000


@dataclass(frozen=True, slots=True)
class SplitKConfig:
    block_n: int = 256
    block_k: int = 32  # codes along K per load
    k_steps: int = 2  # loads per program: a program covers block_k * k_steps rows, inside one group
    num_warps: int = 2
    num_stages: int = 1
    reduce: str = "last"
    unpack: bool = False  # one row: each word loaded once, its codes taken field by field (not repeated loads)
    in_place: bool = False  # one row: fields masked in place, the activation scaled instead (_one_row_in_place)
    half2: bool = False  # one row, 16-bit activations, 4 bits: two codes an fp16x2 instruction (w4a16_half2.py)
    pairs: bool = False  # 2+ rows, 16-bit activations, 4 bits: codes made weights two at a time (w4a16_pairs.py)
    block_m: int = MAX_ROWS  # rows of the tl.dot tile above one row (16, 32 or 64): the launch takes up to this many

    def __post_init__(self) -> None:
        pow2 = all(v > 0 and v & (v - 1) == 0 for v in (self.block_n, self.block_k, self.k_steps, self.num_warps))
        if not pow2 or self.block_n < 16 or self.block_k < 16 or self.num_stages < 1:
            raise ValueError(f"{self}: block_n, block_k, k_steps and num_warps must be powers of two, "
                             "block_n and block_k >= 16")
        if self.reduce not in REDUCES:
            raise ValueError(f"reduce {self.reduce!r} is not one of {REDUCES}")
        if self.block_m not in (16, 32, WIDEST_ROWS):
            raise ValueError(f"{self}: block_m must be 16, 32 or {WIDEST_ROWS}")
        if self.half2 and self.in_place:
            raise ValueError("half2 and in_place are two one-row variants: choose one")

    @property
    def name(self) -> str:
        tail = "".join(t for t, on in (("_unpack", self.unpack), ("_inplace", self.in_place), ("_half2", self.half2),
                                       ("_pairs", self.pairs)) if on)
        tail += f"_m{self.block_m}" if self.block_m != MAX_ROWS else ""
        sizes = f"{self.block_n}_{self.block_k}_{self.k_steps}_{self.num_warps}_{self.num_stages}"
        return f"splitk_{sizes}_{self.reduce}{tail}"


# The launches the rule runs, from the H200 run of 2026-11-30 (benchmarks/results/gpu-check-h200-2026-11-30.json,
# 15 settings at M = 1 and 16): chosen on the GPTQ act-order 4096 x 4096 and 4096 x 14336 layers by the worse of the
# two, confirmed on 14336 x 4096 and the AWQ 4096 x 14336 one. One row: 1.29-1.47x of dense fp16 (worst 1.295;
# torch's int4 tinygemm 0.68-1.29x with fp16 activations); 2-16 rows (padded to 16): 0.62-0.72x (tinygemm
# 0.38-0.41x). Fp16 atomics ("atomic") were up to 1.3x faster at 16 rows but sum 64-448 partials in fp16 (3x the
# error of the workspace's fp32 sums, and an order that varies run to run), so the deterministic "last" is used.
ONE_ROW = SplitKConfig(block_n=512, block_k=32, k_steps=2, num_warps=2, num_stages=1, reduce="last", unpack=True)
ROWS = SplitKConfig(block_n=256, block_k=32, k_steps=4, num_warps=4, num_stages=2, reduce="last")


def config_for(m: int) -> SplitKConfig:
    return ONE_ROW if m == 1 else ROWS


@triton.jit
def _rows_dot(x_ptr, perm_ptr, qw_ptr, bias, offs_n, n_ok, k_first, M, K, stride_xm, stride_qk, BITS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
              PERMUTED: tl.constexpr, DOT_16BIT: tl.constexpr):
    """Up to BLOCK_M rows through tl.dot, the integer weights exact in the activation's 16-bit type."""
    PF: tl.constexpr = 32 // BITS
    offs_k = tl.arange(0, BLOCK_K)
    shift = ((offs_k % PF) * BITS)[:, None]
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in tl.static_range(K_STEPS):
        k = k_first + step * BLOCK_K + offs_k
        k_ok = k < K
        words = tl.load(qw_ptr + (k // PF).to(tl.int64)[:, None] * stride_qk + offs_n[None, :],
                        mask=k_ok[:, None] & n_ok[None, :], other=0, eviction_policy="evict_first")
        src = tl.load(perm_ptr + k, mask=k_ok, other=0) if PERMUTED else k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + src[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = _codes_minus_zero(words, shift, bias[None, :], BITS)
        if DOT_16BIT:  # q - z within +-255: exact in fp16 and bf16; fp32 accumulation
            acc += tl.dot(x, w.to(x.dtype))
        else:  # fp32, and bf16 under the interpreter (its bf16 tl.dot is wrong)
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
    return acc


@triton.jit
def _splitk_kernel(x_ptr, perm_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, GROUP,
                   stride_xm, stride_qk, stride_sg, magic, BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, PERMUTED: tl.constexpr,
                   DOT_16BIT: tl.constexpr, UNPACK: tl.constexpr, IN_PLACE: tl.constexpr, HALF2: tl.constexpr,
                   PAIRS: tl.constexpr, LAST: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_first = pid_k * (BLOCK_K * K_STEPS)
    g = k_first // GROUP
    s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    bias = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32) + 8388608.0
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    if BLOCK_M > 1 and PAIRS:
        acc = _rows_pairs(x_ptr, perm_ptr, qw_ptr, bias - 8388608.0, offs_n, n_ok, k_first, M, K, stride_xm, stride_qk,
                          BLOCK_M, BLOCK_N, BLOCK_K, K_STEPS, PERMUTED)
    elif BLOCK_M > 1:
        acc = _rows_dot(x_ptr, perm_ptr, qw_ptr, bias, offs_n, n_ok, k_first, M, K, stride_xm, stride_qk, BITS,
                        BLOCK_M, BLOCK_N, BLOCK_K, K_STEPS, PERMUTED, DOT_16BIT)
    elif HALF2:
        acc = _one_row_half2(x_ptr, perm_ptr, qw_ptr, bias - 8388608.0, offs_n, n_ok, k_first, K, stride_qk, magic,
                             BLOCK_N, BLOCK_K, K_STEPS, PERMUTED)[None, :]
    elif IN_PLACE:
        sum_xq, sum_x = _one_row_in_place(x_ptr, perm_ptr, qw_ptr, offs_n, n_ok, k_first, K, stride_qk, magic, BITS,
                                          BLOCK_N, BLOCK_K, K_STEPS, PERMUTED)
        acc = (sum_xq - sum_x * (bias - 8388608.0))[None, :]
    elif UNPACK:
        acc = _one_row_unpacked(x_ptr, perm_ptr, qw_ptr, bias, offs_n, n_ok, k_first, K, stride_qk, BITS, BLOCK_N,
                                BLOCK_K, K_STEPS, PERMUTED)[None, :]
    else:
        acc = _one_row_repeated(x_ptr, perm_ptr, qw_ptr, bias, offs_n, n_ok, k_first, K, stride_qk, BITS, BLOCK_N,
                                BLOCK_K, K_STEPS, PERMUTED)[None, :]
    part = acc * s[None, :]
    tile_ok = m_ok[:, None] & n_ok[None, :]
    tile = offs_m[:, None] * N + offs_n[None, :]
    if LAST:
        tl.atomic_add(ws_ptr + tile, part, mask=tile_ok, sem="relaxed", scope="gpu")
        tl.debug_barrier()  # every thread's add issued before the (release) count below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            # An atomic read: the sums live in L2, where the other programs' adds landed (L1 may hold none).
            total = tl.atomic_add(ws_ptr + tile, tl.zeros_like(part), mask=tile_ok, sem="relaxed", scope="gpu")
            tl.store(out_ptr + tile, total.to(out_ptr.dtype.element_ty), mask=tile_ok)
            tl.store(ws_ptr + tile, tl.zeros_like(part), mask=tile_ok)  # clean for the next call
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        tl.atomic_add(out_ptr + tile, part.to(out_ptr.dtype.element_ty), mask=tile_ok, sem="relaxed", scope="gpu")


def span_for(layout: DecodeLayout, cfg: SplitKConfig) -> tuple[int, int]:
    """(block_k, k_steps): the configured span shrunk to the largest power of two dividing the group length (a span
    never straddles two groups); one group takes any span."""
    span = cfg.block_k * cfg.k_steps
    if layout.group_size < layout.in_features:
        while span > 16 and layout.group_size % span:
            span //= 2
    block_k = min(cfg.block_k, span)
    return block_k, span // block_k


def sums_last(cfg: SplitKConfig, dtype: torch.dtype) -> bool:
    """Whether partial sums meet in the workspace: "last", and bf16 always (its atomics are Hopper-only and not in
    Triton's interpreter)."""
    return cfg.reduce == "last" or dtype == torch.bfloat16


class SplitKWorkspace:
    """The "last" reduction's fp32 sums and per-tile counters, zero between calls (the kernel leaves them so); sized
    for the widest tile's rows (WIDEST_ROWS) and the narrowest tile of `columns` outputs."""

    def __init__(self, columns: int, device: torch.device):
        self.columns = columns
        self.sums = torch.zeros(WIDEST_ROWS * columns, dtype=torch.float32, device=device)
        self.counts = torch.zeros(-(-columns // 16), dtype=torch.int32, device=device)


_SHARED: dict[tuple[str, int | None], SplitKWorkspace] = {}


def shared_workspace(columns: int, device: torch.device) -> SplitKWorkspace:
    """The device's one workspace, grown to `columns` if narrower. Layers run one after another on one stream and
    each call leaves the workspace zero, so all of a model's layers share it (256 bytes a column of the widest: 3.7 MB
    for a 14336-wide layer, where one per layer would take 350 MB on a 4-bit Llama-3-8B). Layers call this at load
    with their width, so a forward (and a CUDA graph capture) never allocates."""
    key = (device.type, device.index)
    ws = _SHARED.get(key)
    if ws is None or ws.columns < columns:
        ws = _SHARED[key] = SplitKWorkspace(columns, device)
    return ws


def splitk_gemv(x: torch.Tensor, layout: DecodeLayout, workspace: SplitKWorkspace | None,
                cfg: SplitKConfig | None = None) -> torch.Tensor:
    """x [M, K] (fp16, bf16 or fp32) in the checkpoint's K order -> [M, N] in x.dtype, with `cfg` or the measured
    launch for M rows; M up to the launch's `block_m` (16 for the measured ones). The "last" reduction needs a
    `workspace` at least N wide (shared_workspace)."""
    m, n, k = x.shape[0], layout.out_features, layout.in_features
    cfg = cfg or config_for(m)
    if not 0 < m <= cfg.block_m:
        raise ValueError(f"splitk_gemv takes 1..{cfg.block_m} rows with {cfg.name}, got {m}")
    last = sums_last(cfg, x.dtype)
    if last and (workspace is None or workspace.columns < n):
        raise ValueError(f"the 'last' reduction needs a SplitKWorkspace of at least {n} columns")
    perm = layout.perm
    x = x.contiguous()
    block_k, k_steps = span_for(layout, cfg)
    block_m = 1 if m == 1 else cfg.block_m
    group = layout.group_size if layout.group_size < k else k
    out = (torch.empty if last else torch.zeros)(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(k, block_k * k_steps))
    dot_16bit = x.dtype == torch.float16 or (x.dtype == torch.bfloat16 and not INTERPRETED)
    half2 = cfg.half2 and half2_takes(x, layout.bits)
    pairs = cfg.pairs and block_m > 1 and pairs_takes(x, layout.bits)
    _splitk_kernel[grid](
        x, perm if perm is not None else x, layout.qweight, layout.scales, layout.zeros, out,
        workspace.sums if last else out, workspace.counts if last else out, m, n, k, group, x.stride(0),
        layout.qweight.stride(0), layout.scales.stride(0), FP16_PAIR_MAGIC if half2 else MANTISSA_MAGIC,
        BITS=layout.bits, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, K_STEPS=k_steps,
        PERMUTED=perm is not None, DOT_16BIT=dot_16bit, UNPACK=cfg.unpack, IN_PLACE=cfg.in_place, HALF2=half2,
        PAIRS=pairs, LAST=last, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
