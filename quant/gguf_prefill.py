"""Long prefill chunks through a GGUF layer that holds nothing but its blocks, where torch's bf16 GEMM outruns the
packed kernels: the matrix dequantized per call into a bf16 scratch (kernels/cpu/packed_grouped_bf16.c), then
torch's bf16 GEMM (oneDNN: AMX tiles, or AVX512-BF16 on a core with full-width 512-bit units), or, for calls below
`AMX_GROUPED_ROWS` rows under AMX and Q4_K/Q5_K's earlier start without it, a scratch in the grouped layout
multiplied by this library's own GEMM (kernels/cpu/dense_gemm.c).

Why: on the AVX-512 tiers the packed many-row kernel (kernels/cpu/packed_grouped_panel16.h) runs at the int16 pair
dots' rate, ~150-220 GFLOP/s per core on a Sapphire Rapids core; AMX tiles multiply bf16 at 400-1100 from a few
dozen rows on, and dequantizing a matrix from its interleaved tiles costs ~3-7 G weights/s per core, so from
`MIN_ROWS` rows on the per-call expansion wins (benchmarks/packed_prefill.py --per-call: docs/quantization.md).
Without AMX the answer depends on the core, not on its flags: on Sapphire Rapids with oneDNN capped at AVX512-BF16
its bf16 GEMM ran below every packed kernel; on Zen 5 it ran 1.4-2.5x the K formats' 16-lane panel kernel from
256 rows on (the slowest packed kernel), and about level with the 4/8-bit tiles' kernel; on Zen 4 the panel kernel
ran Q4_K and Q5_K at ~210 GFLOP/s at every row count and the expansion passed it 1.5-1.6x already at 128 rows,
where Q6_K's kept level (Zen 5: Q4_K 1.5x at 128 too, Q6_K 1.1x). So without AMX a process times the two once, on a
Q4_K matrix of a 1B model's width (`measured_rule`): at 256 rows, and the K formats expand from `NO_AMX_MIN_ROWS`
rows where the expansion was `MARGIN` times faster; then Q4_K and Q5_K's earlier start: from `GROUPED_EARLY_ROWS`
through this library's grouped GEMM (kernels/cpu/dense_gemm.c, AVX512-BF16 dot products over a scratch in its own
layout) where that was `MARGIN` times faster at 64 rows, else from `ROW_MAJOR_EARLY_ROWS` where the row-major
expansion was at 128 (logged either way).
The scratch is a temporary of at most `SLAB_BYTES` (a larger matrix, an LM head, goes in slabs): the heap reuses it
from call to call (engine/host/allocator.py), and no layer keeps an expanded copy.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu.packed import FORMATS, GROUP_ROWS, PackedMatrix, grouped_bf16_available

MIN_ROWS = 64  # with AMX: rows from which the per-call expansion beat the packed kernel on the 1B and SmolLM2 shapes
# With AMX, below this the grouped scratch through dense_gemm.c's tiles: at 64-255 rows 1.0-1.7x the row-major one
# through oneDNN on random Q4_K matrices of the 1B shapes (a layer's sum 2-10% less), level from 512 on
AMX_GROUPED_ROWS = 256
NO_AMX_MIN_ROWS = 256  # without: at 128 rows the Q6_K matrices gained 1.1x at best, from 256 on 1.4x and more
NO_AMX_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K"})  # the panel kernel's formats; the 4/8-bit tiles' kept up
# Q4_K and Q5_K's earlier start (Q6_K's panel kernel kept level at 64-128 rows, 0.76-1.17x). On Zen 4 the scratch in
# the grouped layout through kernels/cpu/dense_gemm.c passed their panel kernel 1.29-1.59x at 64 rows; the row-major
# one through torch 1.48-1.63x at 128 rows but only 1.15-1.24x at 64, too close to MARGIN for a timing to settle.
EARLY_TYPES = frozenset({"Q4_K", "Q5_K"})
GROUPED_EARLY_ROWS = 64
ROW_MAJOR_EARLY_ROWS = 128
MARGIN = 1.25  # how much faster the expansion must time, so that timing noise does not flip a host's path
SLAB_BYTES = 64 << 20  # most bf16 scratch per GEMM: a 1B model's gate_up whole, an LM head in slabs
log = logging.getLogger("pagedserve.quant")


@dataclass(frozen=True, slots=True)
class ExpansionRule:
    """Which calls expand per call: `min_rows` rows or more of a format in `qtypes` (None: every format), and the
    formats in `early_qtypes` from `early_rows` rows already."""

    min_rows: int
    qtypes: frozenset[str] | None = None
    early_rows: int | None = None
    early_qtypes: frozenset[str] = frozenset()
    grouped_below: int = 0  # covered calls of fewer rows expand into the grouped layout for kernels/cpu/dense_gemm.c

    def __post_init__(self) -> None:
        if self.grouped_below < 0:
            raise ValueError(f"grouped_below must be >= 0, got {self.grouped_below}")
        if self.early_qtypes and (self.early_rows is None or not 0 < self.early_rows < self.min_rows):
            raise ValueError(f"early_rows must lie in 1..{self.min_rows - 1} for {sorted(self.early_qtypes)}, "
                             f"got {self.early_rows}")

    def covers(self, qtype: str, rows: int) -> bool:
        if qtype in self.early_qtypes and rows >= self.early_rows:
            return True
        return rows >= self.min_rows and (self.qtypes is None or qtype in self.qtypes)

    def grouped(self, rows: int) -> bool:
        """Whether a covered call of `rows` rows takes the grouped scratch (else the row-major one)."""
        return rows < self.grouped_below


@functools.cache
def _amx_granted() -> bool:
    from pagedserve.kernels.cpu.native import NativeBuildError
    from pagedserve.quant.dense_native import gemm_isa

    try:
        return gemm_isa() == "amx"
    except NativeBuildError:
        return False


@functools.cache
def host_rule(lib: ctypes.CDLL) -> ExpansionRule | None:
    """This process's rule for `lib` (an AVX512-BF16 build): every format from MIN_ROWS with AMX, else what
    `measured_rule` finds."""
    return ExpansionRule(MIN_ROWS, grouped_below=AMX_GROUPED_ROWS) if _amx_granted() else measured_rule(lib)


def settle(packed: PackedMatrix, dtype: torch.dtype) -> None:
    """Decides the host rule now, if a call of `packed` in `dtype` could ever ask for it (once per process)."""
    takes(packed, NO_AMX_MIN_ROWS, dtype)


def takes(packed: PackedMatrix, rows: int, dtype: torch.dtype) -> bool:
    """Whether a call of `rows` rows in `dtype` goes through `dequantized_linear`: bf16 compute, a grouped matrix,
    an AVX512-BF16 build of the packed library, and this host's rule covering the call."""
    if rows < min(MIN_ROWS, GROUPED_EARLY_ROWS) or dtype != torch.bfloat16 or not packed.row_group \
            or not grouped_bf16_available(packed.lib):
        return False
    rule = host_rule(packed.lib)
    return rule is not None and rule.covers(packed.qtype, rows)


def grouped(packed: PackedMatrix, rows: int) -> bool:
    """For a call `takes` gave here: whether its scratch is the grouped one (`dequantized_linear(..., grouped=)`)."""
    rule = host_rule(packed.lib)
    return rule is not None and rule.grouped(rows)


def measured_rule(lib: ctypes.CDLL, rows: int = NO_AMX_MIN_ROWS, width: int = 2048,
                  grouped_rows: int = GROUPED_EARLY_ROWS, row_major_rows: int = ROW_MAJOR_EARLY_ROWS
                  ) -> ExpansionRule | None:
    """Times the packed kernel and the per-call expansion on a `width` x `width` Q4_K matrix at `rows` rows and, where
    the expansion was MARGIN times faster there (the K formats then expand from NO_AMX_MIN_ROWS rows), Q4_K and
    Q5_K's earlier start (`_early_step`); taking turns, best of 3 (~0.1 s once per process)."""
    matrix = _timing_matrix(lib, width)
    packed_s, expanded_s = _best_times(matrix, rows)
    timed = f"{packed_s * 1e3:.1f} / {expanded_s * 1e3:.1f} ms packed / expanded at {rows} rows"
    if packed_s < MARGIN * expanded_s:
        log.info("GGUF prefill: a %d x %d Q4_K matrix in bf16 took %s: every format stays packed", width, width, timed)
        return None
    early, early_timed = _early_step(matrix, grouped_rows, row_major_rows)
    log.info("GGUF prefill: a %d x %d Q4_K matrix in bf16 took %s%s: K formats expand from %d rows%s", width, width,
             timed, early_timed, NO_AMX_MIN_ROWS,
             "" if early is None else f", {' and '.join(sorted(EARLY_TYPES))} from {early[0]}"
             f"{' (grouped)' if early[1] else ''}")
    if early is None:
        return ExpansionRule(NO_AMX_MIN_ROWS, NO_AMX_TYPES)
    return ExpansionRule(NO_AMX_MIN_ROWS, NO_AMX_TYPES, early[0], EARLY_TYPES, NO_AMX_MIN_ROWS if early[1] else 0)


def _early_step(matrix: PackedMatrix, grouped_rows: int, row_major_rows: int
                ) -> tuple[tuple[int, bool] | None, str]:
    """(Q4_K and Q5_K's start, whether grouped) and the timings behind it: from GROUPED_EARLY_ROWS through the grouped
    GEMM where this build runs it in bf16 and it was MARGIN times faster at `grouped_rows`, else from
    ROW_MAJOR_EARLY_ROWS where the row-major expansion was at `row_major_rows`; None where neither was."""
    timed = ""
    if _grouped_gemm_in_bf16():
        packed_s, expanded_s = _best_times(matrix, grouped_rows, grouped=True)
        timed = f", {packed_s * 1e3:.1f} / {expanded_s * 1e3:.1f} ms at {grouped_rows} (grouped)"
        if packed_s >= MARGIN * expanded_s:
            return (GROUPED_EARLY_ROWS, True), timed
    packed_s, expanded_s = _best_times(matrix, row_major_rows)
    timed += f", {packed_s * 1e3:.1f} / {expanded_s * 1e3:.1f} ms at {row_major_rows}"
    return ((ROW_MAJOR_EARLY_ROWS, False) if packed_s >= MARGIN * expanded_s else None), timed


def _grouped_gemm_in_bf16() -> bool:
    """Whether kernels/cpu/dense_gemm.c multiplies bf16 with AVX512-BF16 dot products here (not AMX: a host with
    tiles takes the AMX rule; not fp32 FMAs)."""
    from pagedserve.kernels.cpu.native import NativeBuildError
    from pagedserve.quant.dense_native import gemm_isa

    try:
        return gemm_isa() == "avx512_bf16"
    except NativeBuildError:
        return False


def _best_times(matrix: PackedMatrix, rows: int, grouped: bool = False) -> tuple[float, float]:
    """(packed, expanded) seconds of one call of `rows` rows, best of 3, the two taking turns."""
    x = torch.randn(rows, matrix.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packed_s = expanded_s = float("inf")
    for _ in range(3):
        packed_s = min(packed_s, _seconds(lambda: matrix.matmul(x.float())))
        expanded_s = min(expanded_s, _seconds(lambda: dequantized_linear(matrix, x, grouped)))
    return packed_s, expanded_s


def _timing_matrix(lib: ctypes.CDLL, width: int) -> PackedMatrix:
    """Q4_K blocks whose every byte lies in 0x20-0x3f, so any two of them read as a normal positive fp16 scale."""
    _, per, size = FORMATS["Q4_K"]
    blocks = torch.randint(0x20, 0x40, (width, width // per * size), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    return PackedMatrix("Q4_K", blocks, width, lib=lib).grouped()


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def dequantized_linear(packed: PackedMatrix, x: torch.Tensor, grouped: bool = False) -> torch.Tensor:
    """x [rows, in] bf16 @ W^T + bias in bf16, W (a grouped matrix) dequantized per call, slab by slab: row-major for
    torch's GEMM, or (`grouped`) in the dense grouped layout for kernels/cpu/dense_gemm.c."""
    out, inn = packed.out_features, packed.in_features
    slab = min(out, max(GROUP_ROWS, SLAB_BYTES // (2 * inn) // GROUP_ROWS * GROUP_ROWS))
    scratch = torch.empty(slab, inn, dtype=torch.bfloat16)
    bias = None if packed.bias is None else packed.bias.to(x.dtype)
    if slab == out:
        return _slab_product(packed, x, scratch, 0, bias, grouped)
    y = torch.empty(x.shape[0], out, dtype=x.dtype)
    for o0 in range(0, out, slab):
        o1 = min(out, o0 + slab)
        y[:, o0:o1] = _slab_product(packed, x, scratch[:o1 - o0], o0, None if bias is None else bias[o0:o1], grouped)
    return y


def _slab_product(packed: PackedMatrix, x: torch.Tensor, w: torch.Tensor, first: int, bias: torch.Tensor | None,
                  grouped: bool) -> torch.Tensor:
    packed.dequantize_grouped_bf16(first, first + w.shape[0], w, row_major=not grouped)
    if not grouped:
        return F.linear(x, w, bias)
    from pagedserve.quant.dense_native import dense_gemm, dense_native_linear

    w.pagedserve_row_group = GROUP_ROWS
    return dense_gemm(dense_native_linear(w, bias), x)
