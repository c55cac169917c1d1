"""The native LoRA delta (kernels/cpu/lora.c): one call per layer adds every adapter's x A^T B^T to its rows."""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu.native import dtype_code, load_library

MAX_PARTS = 3  # MAX_PARTS of lora.c: the blocks of a fused layer's block-diagonal B (q/k/v)
REF_FIELDS = 4 + 4 * MAX_PARTS  # a LoraRef: rank, A's and B^T's addresses, part count, parts (int64 each)
MAX_IN = 8192  # MAX_IN of lora.c: a tile of input rows lives on the stack


def lora_ref(a: torch.Tensor | None, b_t: torch.Tensor | None,
             parts: tuple[tuple[int, int, int, int], ...] | None = None) -> list[int]:
    """One adapter's matrices for one layer as the kernel reads them (A [rank, in], B^T [rank, out], fp32, contiguous;
    the caller keeps them alive); None: the adapter leaves the layer alone. parts: B^T's nonzero blocks (rank rows,
    output columns), each [r0, r1) x [c0, c1); None, or columns not on 16-lane bounds: the whole matrix."""
    if a is None:
        return [0] * REF_FIELDS
    assert a.dtype == b_t.dtype == torch.float32 and a.is_contiguous() and b_t.is_contiguous()
    rank, out = b_t.shape
    if not parts or len(parts) > MAX_PARTS or any(c0 % 16 or c1 % 16 for _, _, c0, c1 in parts):
        parts = ((0, rank, 0, out),)
    blocks = [v for part in parts for v in part] + [0] * 4 * (MAX_PARTS - len(parts))
    return [rank, a.data_ptr(), b_t.data_ptr(), len(parts), *blocks]


def supports(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Shapes and layouts the kernel takes: CPU rows of a compute dtype, widths a multiple of 16 (inputs up to
    MAX_IN), unit inner stride."""
    return (x.device.type == "cpu" and x.dim() == 2 and out.dim() == 2 and x.dtype == out.dtype
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.shape[1] % 16 == 0 and x.shape[1] <= MAX_IN
            and out.shape[1] % 16 == 0 and x.stride(1) == 1 and out.stride(1) == 1)


def lora_delta(x: torch.Tensor, out: torch.Tensor, spans: torch.Tensor, refs: torch.Tensor, threads: int) -> None:
    """out[s:e] += x[s:e] A_g^T B_g^T in place for each group g; spans [G, 2] int64, refs [G, REF_FIELDS] int64
    contiguous (lora_ref rows)."""
    status = load_library().pagedserve_lora_delta(
        x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), dtype_code(x.dtype), x.shape[1], out.shape[1],
        spans.shape[0], spans.data_ptr(), refs.data_ptr(), threads)
    if status != 0:
        raise RuntimeError(f"native LoRA delta refused its arguments (status {status})")
