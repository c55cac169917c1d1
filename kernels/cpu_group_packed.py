"""GPTQ/AWQ weights in the native group layout (cpu_group_linear.c), built into kernels/cpu_packed.py's object.

`GroupMatrix` holds one matrix's tensors in that layout (quant/cpu_group_kernel.py makes them from the canonical
GroupQuantWeight) and the C state that points at them; its `state_address` and `linear_fn` are what
kernels/cpu_linear.h's `ps_linear` takes, so the native decode step runs it like any other linear.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu_native import NativeBuildError
from pagedserve.kernels.cpu_packed import build


class GroupState(ctypes.Structure):
    # Field order and types mirror ps_group_state in cpu_group_linear.c.
    _fields_ = [("bits", ctypes.c_int32), ("num_threads", ctypes.c_int32),
                ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64), ("groups", ctypes.c_int64),
                ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("scale_f16", ctypes.c_int32),
                ("pad", ctypes.c_int32), ("zeros", ctypes.c_void_p), ("run_group", ctypes.c_void_p),
                ("perm", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


@dataclass(frozen=True, eq=False)
class GroupMatrix:
    """W [out, in] as codes uint8 [out, in * bits / 8] (input channels in group order, 32 per run), scales
    [out, groups] fp16/fp32, zeros uint8 [out, groups], run_group int32 [in / 32], perm int32 [in] or None."""

    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    run_group: torch.Tensor
    perm: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # fp32 [out]
    lib: ctypes.CDLL | None = None  # None: build()

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
        if self.scales.dtype not in (torch.float16, torch.float32) or not self.scales.is_contiguous():
            raise ValueError(f"scales: expected contiguous float16/float32 [out, groups], got {self.scales.dtype}")
        for name, (shape, dtype) in expect.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"{name}: expected contiguous {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        lib = self.lib or build()
        if lib.pagedserve_group_state_size() != ctypes.sizeof(GroupState):
            raise NativeBuildError("cpu_group_linear.c's ps_group_state does not match GroupState")
        object.__setattr__(self, "lib", lib)
        addr = (lambda t: None if t is None else t.data_ptr())
        state = GroupState(self.bits, 0, in_features, out, groups, self.codes.data_ptr(), self.scales.data_ptr(),
                           int(self.scales.dtype == torch.float16), 0, self.zeros.data_ptr(),
                           self.run_group.data_ptr(), addr(self.perm), addr(self.bias))
        object.__setattr__(self, "state", state)

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
