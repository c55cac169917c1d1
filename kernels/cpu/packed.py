"""The packed-weight CPU library (packed_linear.c and friends: GGUF blocks multiplied in place; GPTQ/AWQ groups,
group_linear.c, group_grouped.c, state in kernels/cpu/group_packed.py), built by kernels/cpu/build.py.

Built apart from the native library so each tier's variant (kernels/cpu/isa.py: AVX512-VNNI, AVX-VNNI, AVX2,
portable C) is small to build and test on any host. `PackedMatrix` holds one weight matrix's blocks and the C state
that points at them; its `state_address` and `linear_fn` are what kernels/cpu/linear.h's `ps_linear` takes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu.build import LibrarySpec, load
from pagedserve.kernels.cpu.structs import PACKED_STRUCTS, PackedState

# GGUF type name -> (PK_* code of packed_blocks.h, values per block, bytes per block).
FORMATS: dict[str, tuple[int, int, int]] = {
    "Q4_0": (0, 32, 18), "Q4_1": (1, 32, 20), "Q5_0": (2, 32, 22), "Q8_0": (3, 32, 34),
    "Q4_K": (4, 256, 144), "Q5_K": (5, 256, 176), "Q6_K": (6, 256, 210),
}


# The interleaved layout (ps_packed_state.row_group): rows per group, and the formats that have it
# (packed_grouped.c: Q4_0/Q4_1/Q8_0; packed_grouped_wide.c: the others).
GROUP_ROWS = 16
GROUPED_FORMATS = tuple(FORMATS)
WIDE_GROUPED_FORMATS = ("Q5_0", "Q4_K", "Q5_K", "Q6_K")  # packed_grouped_wide.c's: 8 lanes in every build


def _declare(lib: ctypes.CDLL) -> None:
    state, ptr, i64, c_int = ctypes.POINTER(PackedState), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pagedserve_packed_linear_threads.argtypes = [state, ptr, i64, ptr, c_int]
    lib.pagedserve_packed_dequantize.argtypes = [state, ptr, i64, ptr, c_int, c_int]
    for fn in (lib.pagedserve_packed_linear_threads, lib.pagedserve_packed_dequantize):
        fn.restype = c_int
    for name in ("pagedserve_group_linear_threads", "pagedserve_group_dequantize"):
        getattr(lib, name).argtypes = [ptr, ptr, i64, ptr, c_int] if "linear" in name else [ptr, ptr, c_int, c_int]
        getattr(lib, name).restype = c_int
    lib.pagedserve_packed_group_rows.argtypes = [state, ptr]
    lib.pagedserve_packed_group_rows.restype = c_int
    lib.pagedserve_packed_isa.restype = lib.pagedserve_group_isa.restype = ctypes.c_char_p
    lib.pagedserve_packed_grouped_isa.restype = lib.pagedserve_group_grouped_isa.restype = ctypes.c_char_p
    lib.pagedserve_packed_grouped_bf16.argtypes = [state, i64, i64, ptr, c_int, c_int]
    lib.pagedserve_packed_grouped_bf16.restype = c_int
    lib.pagedserve_packed_grouped_isa_of.argtypes = [c_int]
    lib.pagedserve_packed_grouped_isa_of.restype = ctypes.c_char_p


SPEC = LibrarySpec(
    name="packed",
    sources=(*(f"packed_{name}.c" for name in ("linear", "f32", "grouped", "grouped_wide", "grouped_panel",
                                                  "grouped_bf16", "dequantize")),
             "group_linear.c",
             "group_grouped.c"),
    structs=PACKED_STRUCTS,
    declare=_declare,
)


def build(tier: str | None = None) -> ctypes.CDLL:
    """The packed library for `tier` (None: PAGEDSERVE_CPU_ISA's when first built, else -march=native; "native";
    or a tier name of kernels/cpu/isa.py). Raises NativeBuildError (IsaError for a tier this host lacks)."""
    return load(SPEC, tier)


def isa(lib: ctypes.CDLL) -> str:
    """Which integer dot product `lib`'s row kernel was compiled to: avx512_vnni, avx2_vnni, avx2 or portable."""
    return lib.pagedserve_packed_isa().decode()


# The interleaved-rows kernels' builds faster than the file layout's / row-after-row kernels: loaders group rows
# only where the build is one of these: every build with AVX2, all with int16 activations and integer pair dots
# (act_q16.h; they give the same results bit for bit), in 16 lanes (avx512_vnni) or 8 (the others).
FAST_GROUPED_ISAS = ("avx512_vnni", "avx512", "avx2_vnni", "avx2")
# The builds whose interleaved-rows kernels round activations to int16 per block (act_q16.h states the bound).
INT16_GROUPED_ISAS = FAST_GROUPED_ISAS
# The builds whose interleaved-rows kernels have a many-row form (packed_grouped_panel.c, every format, from 8 rows
# on; 16 lanes in packed_grouped_panel16.h): codes widened once per 32-input run for all rows, so prefill runs at the
# pair dots' rate, at least that of an fp32 FMA GEMM on the AVX2 tiers and of oneDNN's AVX512-BF16 one on Sapphire
# Rapids without AMX (docs/quantization.md). With AMX (and for the K formats on cores where oneDNN's AVX512-BF16
# GEMM timed faster, as on Zen 5), long bf16 chunks go to quant/gguf_prefill.py instead.
MANY_ROW_GROUPED_ISAS = FAST_GROUPED_ISAS


def grouped_isa(lib: ctypes.CDLL, qtype: str = "Q4_0") -> str:
    """What `qtype`'s interleaved-rows kernel in `lib` was compiled to (see FAST_GROUPED_ISAS). Q4_0/Q4_1/Q8_0
    (packed_grouped.c) and Q5_0 and the K formats (packed_grouped_wide.c): avx512_vnni, avx512, avx2_vnni, avx2 or
    portable."""
    if qtype not in FORMATS:
        raise ValueError(f"qtype: {qtype!r} has no packed kernel; supported: {', '.join(FORMATS)}")
    return lib.pagedserve_packed_grouped_isa_of(FORMATS[qtype][0]).decode()


def grouped_bf16_available(lib: ctypes.CDLL) -> bool:
    """Whether `lib` dequantizes grouped matrices into the dense bf16 grouped layout (AVX512-BF16 builds)."""
    return lib.pagedserve_packed_grouped_bf16(None, 0, 0, None, 0, 1) != 2


def grouped_isas(lib: ctypes.CDLL) -> dict[str, str]:
    """Every format's interleaved-rows build in `lib` (grouped_isa per GGUF type): what a loader serves where it
    is in FAST_GROUPED_ISAS, the file's layout elsewhere."""
    return {qtype: grouped_isa(lib, qtype) for qtype in FORMATS}


def group_isa(lib: ctypes.CDLL) -> str:
    """What the GPTQ/AWQ kernel (group_linear.c) in `lib` was compiled to: avx512, avx2 or portable."""
    return lib.pagedserve_group_isa().decode()


def group_grouped_isa(lib: ctypes.CDLL) -> str:
    """What the GPTQ/AWQ interleaved-rows kernel (group_grouped.c) in `lib` was compiled to: avx512_vnni,
    avx512, avx2_vnni, avx2 or portable (see group_packed.FAST_GROUP_GROUPED_ISAS)."""
    return lib.pagedserve_group_grouped_isa().decode()


@dataclass(frozen=True, eq=False)
class PackedMatrix:
    """One weight matrix [out_features, in_features] as GGUF blocks `blocks` (uint8 [out_features, row_bytes])."""

    qtype: str
    blocks: torch.Tensor
    in_features: int
    bias: torch.Tensor | None = None  # fp32 [out_features]
    lib: ctypes.CDLL | None = None  # None: build()
    int8_max_rows: int = 0  # calls with up to this many rows round x to int8 per 32 values; more: exact fp32 x
    row_group: int = 0  # 0: the file's layout; GROUP_ROWS: rows interleaved by `grouped()` (never int8 x)

    def __post_init__(self) -> None:
        if self.qtype not in FORMATS:
            raise ValueError(f"qtype: {self.qtype!r} has no packed kernel; supported: {', '.join(FORMATS)}")
        if self.row_group not in (0, GROUP_ROWS) or (self.row_group and not self.can_group(self.qtype, self.blocks)):
            raise ValueError(f"row_group: {self.row_group} needs a multiple of {GROUP_ROWS} rows "
                             f"(got {self.qtype}, {self.blocks.shape[0]} rows)")
        code, per, size = FORMATS[self.qtype]
        if self.in_features % per:
            raise ValueError(f"in_features: {self.in_features} is not a multiple of {self.qtype}'s {per}-value blocks")
        blocks = self.blocks
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != self.in_features // per * size:
            raise ValueError(f"blocks: expected uint8 [out, {self.in_features // per * size}], "
                             f"got {blocks.dtype} {tuple(blocks.shape)}")
        if not blocks.is_contiguous():
            raise ValueError("blocks: must be contiguous")
        if self.bias is not None and (self.bias.dtype != torch.float32 or self.bias.shape != blocks.shape[:1]):
            raise ValueError(f"bias: expected float32 [{blocks.shape[0]}]")
        object.__setattr__(self, "lib", self.lib or build())
        state = PackedState(code, 0, self.in_features, blocks.shape[0], blocks.data_ptr(), blocks.shape[1],
                            self.bias.data_ptr() if self.bias is not None else None, self.int8_max_rows,
                            self.row_group)
        object.__setattr__(self, "state", state)

    @staticmethod
    def can_group(qtype: str, blocks: torch.Tensor) -> bool:
        """Whether `grouped()` applies: a packed format with whole groups of GROUP_ROWS rows."""
        return qtype in GROUPED_FORMATS and blocks.dim() == 2 and blocks.shape[0] % GROUP_ROWS == 0

    def grouped(self) -> "PackedMatrix":
        """The same matrix with its rows interleaved in groups (packed_grouped.c), rewritten in place: this
        matrix's blocks then hold the grouped layout, so only the returned matrix reads them correctly."""
        if self.row_group or not self.can_group(self.qtype, self.blocks):
            raise ValueError(f"grouped: needs file-layout blocks with a multiple of {GROUP_ROWS} rows")
        staging = torch.empty_like(self.blocks)
        if self.lib.pagedserve_packed_group_rows(ctypes.byref(self.state), staging.data_ptr()) != 0:
            raise ValueError("grouped: the kernel refused the matrix")
        self.blocks.copy_(staging)
        return PackedMatrix(self.qtype, self.blocks, self.in_features, self.bias, self.lib, 0, GROUP_ROWS)

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def state_address(self) -> int:
        return ctypes.addressof(self.state)

    @property
    def linear_fn(self) -> int:
        """Address of `pagedserve_packed_linear`, a `ps_linear_fn`."""
        return ctypes.cast(self.lib.pagedserve_packed_linear, ctypes.c_void_p).value

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] fp32 contiguous -> fp32 [rows, out] = x @ W^T (+ bias)."""
        assert x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2 and x.shape[1] == self.in_features
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        status = self.lib.pagedserve_packed_linear_threads(
            ctypes.byref(self.state), x.data_ptr(), x.shape[0], y.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise MemoryError(f"packed linear failed (status {status})")
        return y

    def dequantize_grouped_bf16(self, first: int, stop: int, out: torch.Tensor, row_major: bool = False) -> None:
        """Rows [first, stop) (whole groups) of a grouped matrix as bf16 into `out` ([stop - first, in] bf16,
        contiguous): in the dense grouped layout quant/dense_layout.py describes, or row-major
        (packed_grouped_bf16.c). Raises ValueError for a bad request or a build without AVX512-BF16
        (`grouped_bf16_available`)."""
        if (out.dtype != torch.bfloat16 or not out.is_contiguous() or out.shape != (stop - first, self.in_features)
                or first % GROUP_ROWS or stop % GROUP_ROWS):
            raise ValueError(f"out: expected bf16 [{stop - first}, {self.in_features}] for whole groups "
                             f"[{first}, {stop}), got {out.dtype} {tuple(out.shape)}")
        status = self.lib.pagedserve_packed_grouped_bf16(ctypes.byref(self.state), first // GROUP_ROWS,
                                                         stop // GROUP_ROWS, out.data_ptr(), int(row_major),
                                                         torch.get_num_threads())
        if status != 0:
            raise ValueError(f"grouped bf16 dequantize refused (status {status}: 1 a bad request or layout, "
                             "2 no AVX512-BF16 form in this build)")

    def dequantize(self, ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` (int64; None: all) of W as `dtype` (float32 or bfloat16; others are cast from fp32)."""
        if ids is not None:
            ids = ids.to(torch.int64).contiguous()
        n = self.out_features if ids is None else ids.numel()
        native = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = torch.empty(n, self.in_features, dtype=native)
        status = self.lib.pagedserve_packed_dequantize(
            ctypes.byref(self.state), None if ids is None else ids.data_ptr(), n, out.data_ptr(),
            int(native == torch.bfloat16), torch.get_num_threads())
        if status == 3:
            raise IndexError(f"row id out of range [0, {self.out_features})")
        if status != 0:
            raise ValueError(f"packed dequantize failed (status {status})")
        return out.to(dtype)
