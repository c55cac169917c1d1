"""GPTQ/AWQ weights in the native group layouts (group_linear.c, group_grouped.c), built into
kernels/cpu/packed.py's object.

`GroupMatrix` holds one matrix's tensors in that layout (quant/cpu_group_kernel.py makes them from the canonical
GroupQuantWeight; `grouped()` interleaves the rows) and the C state that points at them; its `state_address` and
`linear_fn` are what kernels/cpu/linear.h's `ps_linear` takes, so the native decode step runs it like any other
linear.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu.packed import GROUP_ROWS, build
from pagedserve.kernels.cpu.structs import GroupState

# The builds of the interleaved-rows GPTQ/AWQ kernel (group_grouped.c, `group_grouped_isa`) faster than the
# row-after-row one: loaders group rows only there. avx512 (without VNNI+VBMI), avx2_vnni and avx2 (8 lanes, int16
# dots) sum exactly as avx512_vnni (16); portable is slower.
FAST_GROUP_GROUPED_ISAS = ("avx512_vnni", "avx512", "avx2_vnni", "avx2")


@dataclass(frozen=True, eq=False)
class GroupMatrix:
    """W [out, in] as codes uint8 [out, in * bits / 8] (input channels in group order, 32 per run), scales
    [out, groups] fp16/fp32, zeros uint8 [out, groups], run_group int32 [in / 32], perm int32 [in] or None.
    row_group GROUP_ROWS: codes, scales and zeros hold the same values with rows interleaved (`grouped()`)."""

    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    run_group: torch.Tensor
    perm: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # fp32 [out]
    lib: ctypes.CDLL | None = None  # None: build()
    row_group: int = 0  # 0: one row after another; GROUP_ROWS: interleaved (group_grouped.c)

    def __post_init__(self) -> None:
        out, groups = self.scales.shape
        in_features = self.run_group.numel() * 32
        expect = {"codes": ((out, in_features * self.bits // 8), torch.uint8), "zeros": ((out, groups), torch.uint8),
                  "run_group": ((in_features // 32,), torch.int32)}
        if self.perm is not None:
            expect["perm"] = ((in_features,), torch.int32)
        if self.bias is not None:
            expect["bias"] = ((out,), torch.float32)
        if self.bits not in (4, 8):
            raise ValueError(f"bits: {self.bits}, supported: [4, 8]")
        if self.row_group not in (0, GROUP_ROWS) or out % GROUP_ROWS * self.row_group:
            raise ValueError(f"row_group: {self.row_group} needs 0, or {GROUP_ROWS} with a multiple of {GROUP_ROWS} "
                             f"output rows (got {out})")
        if self.scales.dtype not in (torch.float16, torch.float32) or not self.scales.is_contiguous():
            raise ValueError(f"scales: expected contiguous float16/float32 [out, groups], got {self.scales.dtype}")
        for name, (shape, dtype) in expect.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"{name}: expected contiguous {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        object.__setattr__(self, "lib", self.lib or build())
        addr = (lambda t: None if t is None else t.data_ptr())
        state = GroupState(self.bits, 0, in_features, out, groups, self.codes.data_ptr(), self.scales.data_ptr(),
                           int(self.scales.dtype == torch.float16), self.row_group, self.zeros.data_ptr(),
                           self.run_group.data_ptr(), addr(self.perm), addr(self.bias))
        object.__setattr__(self, "state", state)

    def grouped(self) -> "GroupMatrix":
        """The same matrix with its rows interleaved in groups of GROUP_ROWS (layout in group_grouped.c), in
        new tensors; raises ValueError when out_features is not a multiple of GROUP_ROWS."""
        out, h = self.out_features, self.out_features // GROUP_ROWS
        if self.row_group or out % GROUP_ROWS:
            raise ValueError(f"grouped: needs a row-after-row matrix with a multiple of {GROUP_ROWS} rows, got {out}")
        runs = self.in_features // 32
        if self.bits == 4:  # each run's byte l: values l (low nibble) and l + 16
            c = self.codes.view(out, runs, 16)
            q = torch.cat([c & 0xF, c >> 4], 2).view(h, GROUP_ROWS, runs, 4, 4, 2)
            # tile [h, run]: chunk c, row r, byte b = inputs 8c + 2b (low nibble) and 8c + 2b + 1
            codes = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 3, 1, 4)
        else:  # tile [h, run]: input k, row r
            codes = self.codes.view(h, GROUP_ROWS, self.in_features).transpose(1, 2)
        side = (lambda t: t.view(h, GROUP_ROWS, -1).transpose(1, 2).contiguous().view(out, -1))
        return dataclasses.replace(self, codes=codes.contiguous().view(out, -1), scales=side(self.scales),
                                   zeros=side(self.zeros), row_group=GROUP_ROWS)

    @property
    def in_features(self) -> int:
        return self.run_group.numel() * 32

    @property
    def out_features(self) -> int:
        return self.scales.shape[0]

    @property
    def state_address(self) -> int:
        return ctypes.addressof(self.state)

    @property
    def linear_fn(self) -> int:
        """Address of `pagedserve_group_linear`, a `ps_linear_fn`."""
        return ctypes.cast(self.lib.pagedserve_group_linear, ctypes.c_void_p).value

    def nbytes(self) -> int:
        parts = (self.codes, self.scales, self.zeros, self.run_group, self.perm, self.bias)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] fp32 contiguous, columns in the checkpoint's order -> fp32 [rows, out] = x @ W^T (+ bias)."""
        assert x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2 and x.shape[1] == self.in_features
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        status = self.lib.pagedserve_group_linear_threads(ctypes.byref(self.state), x.data_ptr(), x.shape[0],
                                                          y.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise MemoryError(f"group linear failed (status {status})")
        return y

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] with input channels in group order (x must be permuted by `perm` to match), fp32 or bf16."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype: {dtype}, supported: float32, bfloat16")
        w = torch.empty(self.out_features, self.in_features, dtype=dtype)
        status = self.lib.pagedserve_group_dequantize(ctypes.byref(self.state), w.data_ptr(),
                                                      int(dtype == torch.bfloat16), torch.get_num_threads())
        if status != 0:
            raise ValueError(f"group dequantize failed (status {status})")
        return w
