"""The `w4a16` quantized linear: GPTQ/AWQ (4 or 8 bits) on CUDA through the decode layout (w4a16_layout.py).

Which path serves M rows is RULE's (w4a16_rule.py, set from device runs): the wide split-K GEMV (w4a16_splitk.py)
for decode rows, torch's int4 tinygemm for a few more bf16 rows of the 4-bit layers it fits, else the weight
dequantized once per call into a transient dense tile that cuBLAS multiplies; the looped GEMV (w4a16_gemv.py) and
the split-K tile kernel (w4a16_triton.py) stay selectable. Act-order weights were sorted by group at load: the
GEMVs gather the activation through the permutation, the other paths permute it once per call (index_select;
capturable in a CUDA graph like the rest).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedserve.quant import tinygemm
from pagedserve.quant.group_quant import GroupQuantWeight, QLinearKernel
from pagedserve.quant.w4a16_layout import DecodeLayout, repack
from pagedserve.quant.w4a16_layout import unsupported_reason as layout_reason
from pagedserve.quant.w4a16_fused import fused_gemm, fused_takes
from pagedserve.quant.w4a16_rule import RULE
from pagedserve.quant.w4a16_gemv import gemv
from pagedserve.quant.w4a16_splitk import SplitKConfig, SplitKWorkspace, config_for, shared_workspace, splitk_gemv
from pagedserve.quant.w4a16_triton import decode_gemm, dequantize_t, dequantize_t_into

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The dense tile of `dense_chunked`: at most this share of the device's L2 of columns at a time, so a chunk is still
# in L2 when cuBLAS reads it, where the whole tile (117 MiB at 4096 x 14336 fp16) goes to HBM and back: on the H200
# that round trip (~54 us at copy bandwidth) is what the dense path lost at M = 512 (149 us against fp16's 94.5).
DENSE_CHUNK_L2_SHARE = 0.5


class W4A16Kernel(QLinearKernel):
    name = "w4a16"

    def __init__(self, w: GroupQuantWeight, dtype: torch.dtype | None = None):
        """`dtype`: the model's activations, when known (tinygemm is kept only where the rule can pick it for them)."""
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
        # Some decode rows go through tinygemm where the layer fits it (w4a16_rule.py); the decode layout above stays
        # for the GEMV and prefill's dequantize + cuBLAS, which tinygemm is 20x slower at: the packed weight is held
        # twice (4 + 4 bits a weight, half of fp16), so only where the rule can pick it for this model's dtype.
        wanted = dtype is None or RULE.path(RULE.tinygemm_below_m - 1, dtype, True) == "tinygemm"
        fits = wanted and RULE.tinygemm_below_m > 0 and tinygemm.unsupported_reason(w) is None \
            and (w.qweight.is_cuda or w.out_features % 16 == 0)  # torch's CPU op (tests) also wants N % 16
        self.small = tinygemm.TinyGemmKernel(w, layout) if fits else None
        if RULE.splitk_max_m > 0:  # the GEMV's reduction workspace, grown here so that no forward allocates
            shared_workspace(self.out_features, layout.qweight.device)

    @classmethod
    def unsupported_reason(cls, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return f"needs a CUDA device, got {device.type}"
        if dtype not in SUPPORTED_DTYPES:
            return f"needs an activation dtype in {SUPPORTED_DTYPES}, got {dtype}"
        return layout_reason(w)

    @classmethod
    def from_weight(cls, w: GroupQuantWeight, dtype: torch.dtype) -> "W4A16Kernel":
        return cls(w, dtype)

    def layout(self) -> DecodeLayout:
        return DecodeLayout(self.qweight, self.scales, self.zeros, self.perm, self.bits, self.group_size,
                            self.in_features, self.out_features)

    def splitk(self, x: torch.Tensor, cfg: SplitKConfig | None = None) -> torch.Tensor:
        """The split-K GEMV (gathers act-order's permutation itself), with `cfg` or the measured launch."""
        return splitk_gemv(x, self.layout(), self.workspace(), cfg)

    def workspace(self) -> SplitKWorkspace:
        return shared_workspace(self.out_features, self.qweight.device)

    def forward(self, x: torch.Tensor, force: str | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N]; `force` (a w4a16_rule.PATHS name, or "gemv_serial" / "decode_serial" /
        "splitk_last" / "splitk_atomic" / "dense_chunked[_<percent of L2>]" / "fused", which takes 16-bit rows of
        4-bit layers and gives others `dense`) overrides the rule (tests, bench)."""
        path = force or RULE.path(x.shape[0], x.dtype, self.small is not None)
        if path == "tinygemm":
            return self.small(x)
        if path.startswith("splitk"):  # "splitk" (the measured launch) or "splitk_last" / "splitk_atomic"
            cfg = config_for(x.shape[0])
            return self.splitk(x, cfg if path == "splitk" else replace(cfg, reduce=path.removeprefix("splitk_")))
        if path in ("gemv", "gemv_serial"):  # gathers act-order's permutation itself
            serial = path == "gemv_serial" or (force is None and RULE.serial_reduce)
            return gemv(x, self.layout(), locks=self.locks if serial else None)
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        x = x.contiguous()
        if path == "fused" and fused_takes(x, self.bits):  # a bench candidate until a device run places it
            return fused_gemm(x, self.layout())
        if path in ("dense", "fused"):
            return torch.mm(x, dequantize_t(self.layout(), x.dtype))
        if path.startswith("dense_chunked"):  # "dense_chunked" or "dense_chunked_<percent of L2>" (bench)
            percent = path.removeprefix("dense_chunked").lstrip("_")
            share = int(percent) / 100 if percent else DENSE_CHUNK_L2_SHARE
            return dense_by_chunks(x, self.layout(), chunk_bytes(x.device, share))
        serial = path == "decode_serial" or (force is None and RULE.serial_reduce)
        return decode_gemm(x, self.layout(), locks=self.locks if serial else None)


def chunk_bytes(device: torch.device, l2_share: float) -> int:
    """`l2_share` of the device's L2 (24 MiB where there is none to ask: CPU tests)."""
    if device.type != "cuda":
        return 24 << 20
    return int(l2_share * torch.cuda.get_device_properties(device).L2_cache_size)


def dense_by_chunks(x: torch.Tensor, layout: DecodeLayout, max_bytes: int) -> torch.Tensor:
    """x [M, K] (in the layout's K order) @ the dense weight, dequantized and multiplied a column chunk of at most
    `max_bytes` at a time through one reused buffer (whole 64-column tiles; one chunk: the plain dense path)."""
    m, k, n = x.shape[0], layout.in_features, layout.out_features
    cols = max(64, max_bytes // (k * x.element_size()) // 64 * 64)
    if cols >= n:
        return torch.mm(x, dequantize_t(layout, x.dtype))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    buffer = torch.empty(k, cols, dtype=x.dtype, device=x.device)
    for n0 in range(0, n, cols):
        width = min(cols, n - n0)
        torch.mm(x, dequantize_t_into(layout, n0, buffer[:, :width]), out=out[:, n0:n0 + width])
    return out
