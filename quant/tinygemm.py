"""torch's int4 "tinygemm" kernel (`aten._weight_int4pack_mm`, as gpt-fast and torchao use) for 4-bit GPTQ/AWQ.

tinygemm dequantizes w = (q - 8) * scale + zero with a float zero per group and column, so an integer zero point z
becomes zero = (8 - z) * scale: (q - 8) * s + (8 - z) * s = (q - z) * s. Scale and zero are stored together as
bf16 [groups, N, 2]; the CUDA op takes bf16 activations only (an fp16 model's are cast to bf16 and back), group
lengths 32/64/128/256 with K a multiple of the group and of 16 x inner_k_tiles, and N a multiple of 8. A longer
uniform group (including one group over all of K) is expressed by repeating its scale and zero over 256-row groups,
which is exact. Act-order weights are sorted by group at load (w4a16_layout.repack) and the activation permuted.

bf16 scales and zeros cost precision against the checkpoint's fp16 scales (about 2^-9 relative per weight), which is
why the selection rule (w4a16_rule.py) does not choose this kernel for fp16 models until measured worth it.
"""

from __future__ import annotations

import torch

from pagedserve.quant import w4a16_layout
from pagedserve.quant.group_quant import GroupQuantWeight, QLinearKernel, sorted_groups
from pagedserve.quant.packing import unpack_rows
from pagedserve.quant.w4a16_layout import DecodeLayout

TINYGEMM_GROUPS = (256, 128, 64, 32)
INNER_K_TILES = (8, 4, 2)


def tinygemm_group(layout: DecodeLayout) -> int | None:
    """The tinygemm group length that tiles the layout's groups (K for one group) and K exactly, or None."""
    k = layout.in_features
    return next((g for g in TINYGEMM_GROUPS if layout.group_size % g == 0 and k % g == 0), None)


def inner_k_tiles(k: int) -> int | None:
    return next((t for t in INNER_K_TILES if k % (16 * t) == 0), None)


def unsupported_reason(w: GroupQuantWeight) -> str | None:
    if w.bits != 4:
        return f"4-bit only, got {w.bits}-bit"
    reason = w4a16_layout.unsupported_reason(w)
    if reason is not None:
        return reason
    if w.out_features % 8:
        return f"N={w.out_features} is not a multiple of 8"
    if inner_k_tiles(w.in_features) is None:
        return f"K={w.in_features} is not a multiple of 32"
    _, sorted_g = sorted_groups(w.g_idx)
    run = w4a16_layout.uniform_run(sorted_g)
    if not any(run % g == 0 and w.in_features % g == 0 for g in TINYGEMM_GROUPS):
        return f"group size {run} with K={w.in_features} is not a multiple of one of {TINYGEMM_GROUPS}"
    return None


def scales_and_zeros(layout: DecodeLayout) -> tuple[int, torch.Tensor]:
    """(tinygemm group length, bf16 [K / group, N, 2] of scale and float zero (8 - z) * s)."""
    group = tinygemm_group(layout)
    assert group is not None, "check unsupported_reason first"
    rows = torch.arange(0, layout.in_features, group, device=layout.scales.device) // layout.group_size
    s = layout.scales.float().index_select(0, rows)
    zero = (8.0 - layout.zeros.float().index_select(0, rows)) * s
    return group, torch.stack([s, zero], dim=-1).to(torch.bfloat16).contiguous()


def int4_values(layout: DecodeLayout) -> torch.Tensor:
    """int32 [N, K] of the 4-bit values in sorted K order: the CPU op's input."""
    return unpack_rows(layout.qweight, 4).t().contiguous()


def cuda_input(values: torch.Tensor) -> torch.Tensor:
    """The CUDA op's input since torch 2.5: uint8 [N, K / 2], the even K index in the high nibble."""
    return ((values[:, ::2] << 4) | values[:, 1::2]).to(torch.uint8)


def emulate(x: torch.Tensor, values: torch.Tensor, group: int, sz: torch.Tensor) -> torch.Tensor:
    """tinygemm's arithmetic in fp32 torch: x @ ((q - 8) * scale + zero).T, per `group` rows of K."""
    g = torch.arange(values.shape[1], device=values.device) // group
    szf = sz.float()
    w = (values.float() - 8.0) * szf[:, :, 0].t().index_select(1, g) + szf[:, :, 1].t().index_select(1, g)
    return x.float() @ w.t()


def pack(values: torch.Tensor) -> torch.Tensor:
    """tinygemm's packed weight on values' device. CPU (the dry run and tests) has its own op with the same
    arithmetic and an int32 [N, K] input; the auto choice only ever picks this kernel on CUDA."""
    k = values.shape[1]
    if values.is_cuda:
        return torch.ops.aten._convert_weight_to_int4pack(cuda_input(values), inner_k_tiles(k))
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, inner_k_tiles(k))


class TinyGemmKernel(QLinearKernel):
    """4-bit weights in tinygemm's packed layout; every row count goes through the op (no dense copy kept)."""

    name = "tinygemm"

    def __init__(self, w: GroupQuantWeight, layout: DecodeLayout | None = None):
        """`layout`: w's decode layout where the caller holds it already (w4a16 keeps one beside this kernel)."""
        super().__init__()
        self.in_features, self.out_features = w.in_features, w.out_features
        layout = layout if layout is not None else w4a16_layout.repack(w)
        self.group, sz = scales_and_zeros(layout)
        self.register_buffer("perm", layout.perm)
        self.register_buffer("packed", pack(int4_values(layout)))
        self.register_buffer("scales_and_zeros", sz)

    @classmethod
    def unsupported_reason(cls, w: GroupQuantWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return f"needs a CUDA device, got {device.type}"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "needs compute capability 8.0 or newer"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"needs fp16 or bf16 activations, got {dtype}"
        return unsupported_reason(w)

    @classmethod
    def from_weight(cls, w: GroupQuantWeight, dtype: torch.dtype) -> "TinyGemmKernel":
        return cls(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        xb = x.to(torch.bfloat16).contiguous()
        if self.packed.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(xb, self.packed, self.group, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.group, self.scales_and_zeros)
        return y.to(x.dtype)
