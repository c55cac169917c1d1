"""The `w4a16` quantized linear: GPTQ/AWQ (4 or 8 bits) on CUDA through the decode layout (w4a16_layout.py).

Which path serves M rows is RULE's (w4a16_rule.py, set from device runs): torch's int4 tinygemm for decode rows of
4-bit layers it fits, else the weight dequantized once per call into a transient dense tile that cuBLAS multiplies;
the wide split-K GEMV (w4a16_splitk.py), the GEMV (w4a16_gemv.py) and the split-K tile kernel (w4a16_triton.py)
stay selectable. Act-order weights were sorted by group
at load, so the activation is permuted once per call (index_select; capturable in a CUDA graph like the rest).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedserve.quant import tinygemm
from pagedserve.quant.group_quant import GroupQuantWeight, QLinearKernel
from pagedserve.quant.w4a16_layout import DecodeLayout, repack
from pagedserve.quant.w4a16_layout import unsupported_reason as layout_reason
from pagedserve.quant import w4a16_rule
from pagedserve.quant.w4a16_gemv import gemv
from pagedserve.quant.w4a16_splitk import DEFAULT as SPLITK_DEFAULT
from pagedserve.quant.w4a16_splitk import REDUCES as SPLITK_REDUCES
from pagedserve.quant.w4a16_splitk import SplitKConfig, SplitKWorkspace, splitk_gemv, sums_last
from pagedserve.quant.w4a16_triton import decode_gemm, dequantize_t

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SPLITK_BY_REDUCE = {reduce: replace(SPLITK_DEFAULT, reduce=reduce) for reduce in SPLITK_REDUCES}


class W4A16Kernel(QLinearKernel):
    name = "w4a16"

    def __init__(self, w: GroupQuantWeight):
        super().__init__()
        layout = repack(w)
        self.bits, self.group_size = layout.bits, layout.group_size
        self.in_features, self.out_features = layout.in_features, layout.out_features
        for field in ("qweight", "scales", "zeros", "perm"):
            self.register_buffer(field, getattr(layout, field))
        # One counter per output tile of the serial split-K reduction; below dense rows a launch has one row of
        # tiles, at most N / 16 of them (the narrowest tile). The kernel leaves them zero after every call.
        locks = torch.zeros(-(-layout.out_features // 16), dtype=torch.int32, device=layout.qweight.device)
        self.register_buffer("locks", locks, persistent=False)
        # Decode rows go through tinygemm where the layer fits it (w4a16_rule.py); the decode layout above stays for
        # prefill's dequantize + cuBLAS, which tinygemm is 20x slower at: the packed weight is held twice (4 + 4 bits
        # a weight, half of fp16).
        rule = w4a16_rule.RULE  # the module's, read at use: a benchmark compares rules in one process
        fits = rule.tinygemm_below_m > 0 and tinygemm.unsupported_reason(w) is None \
            and (w.qweight.is_cuda or w.out_features % 16 == 0)  # torch's CPU op (tests) also wants N % 16
        self.small = tinygemm.TinyGemmKernel(w, layout) if fits else None
        # The split-K GEMV's "last" reduction keeps fp32 sums and counters per layer (64 bytes a column); made only
        # where the rule can pick it, or on the first forced call (tests, bench), never inside a graph capture.
        self.splitk_workspace = SplitKWorkspace(self.out_features, layout.qweight.device) \
            if rule.splitk_max_m > 0 else None

    @classmethod
    def unsupported_reason(cls, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return f"needs a CUDA device, got {device.type}"
        if dtype not in SUPPORTED_DTYPES:
            return f"needs an activation dtype in {SUPPORTED_DTYPES}, got {dtype}"
        return layout_reason(w)

    @classmethod
    def from_weight(cls, w: GroupQuantWeight, dtype: torch.dtype) -> "W4A16Kernel":
        return cls(w)

    def layout(self) -> DecodeLayout:
        return DecodeLayout(self.qweight, self.scales, self.zeros, self.perm, self.bits, self.group_size,
                            self.in_features, self.out_features)

    def splitk(self, x: torch.Tensor, cfg: SplitKConfig) -> torch.Tensor:
        """The split-K GEMV (gathers act-order's permutation itself)."""
        if sums_last(cfg, x.dtype) and self.splitk_workspace is None:
            self.splitk_workspace = SplitKWorkspace(self.out_features, self.qweight.device)
        return splitk_gemv(x, self.layout(), self.splitk_workspace, cfg)

    def forward(self, x: torch.Tensor, force: str | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N]; `force` (a w4a16_rule.PATHS name, or "gemv_serial" / "decode_serial" /
        "splitk_last" / "splitk_atomic") overrides the rule (tests, bench)."""
        rule = w4a16_rule.RULE
        path = force or rule.path(x.shape[0], x.dtype, self.small is not None)
        if path == "tinygemm":
            return self.small(x)
        if path.startswith("splitk"):  # "splitk" (the rule's reduction) or "splitk_last" / "splitk_atomic"
            return self.splitk(x, SPLITK_BY_REDUCE[path.removeprefix("splitk_") if "_" in path
                                                   else rule.splitk_reduce])
        if path in ("gemv", "gemv_serial"):  # gathers act-order's permutation itself
            serial = path == "gemv_serial" or (force is None and rule.serial_reduce)
            return gemv(x, self.layout(), locks=self.locks if serial else None)
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        x = x.contiguous()
        if path == "dense":
            return torch.mm(x, dequantize_t(self.layout(), x.dtype))
        serial = path == "decode_serial" or (force is None and rule.serial_reduce)
        return decode_gemm(x, self.layout(), locks=self.locks if serial else None)
