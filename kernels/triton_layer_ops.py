"""The "triton" layer ops: RMSNorm (with the residual add), SiLU-and-mul and RoPE as one Triton kernel each.

A graphed decode step of a 1B-shaped Llama on an H200 spent ~97 us a layer against ~30 us of fp16 weight reads
(docs/gpu.md): torch's RMSNorm is seven small kernels (cast, pow, mean, add, rsqrt, mul, cast, mul), the residual
add one more, RoPE four per tensor and SiLU-and-mul two, about 30 launches a layer, each a few microseconds even
inside a CUDA graph. Here each op is one launch, one program per row (per token and head for RoPE).

Each kernel rounds where torch's op order rounds, so 16-bit results match TorchLayerOps' but for the RMS sum's
order (an fp32 tree here, a block reduction there): fp16 sums and products are rounded to the model dtype after
each of torch's ops, as fp32 arithmetic followed by a cast does exactly for one multiply or add of 16-bit values.
Used for 16-bit models on CUDA (fp32 keeps the torch ops, bit for bit with transformers); tensors the kernels do not
take (non-dense rows) go to the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.layer_ops import LayerOps, TorchLayerOps

TRITON_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, width, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * width
    offs = tl.arange(0, BLOCK)
    ok = offs < width
    x = tl.load(x_ptr + row + offs, mask=ok, other=0.0)
    if ADD:  # residual + delta, rounded to the dtype as torch's add is, and kept as the new residual
        x = (x.to(tl.float32) + tl.load(delta_ptr + row + offs, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(x_ptr + row + offs, x, mask=ok)
    h = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / width + eps)
    normed = (h * inv).to(x.dtype).to(tl.float32)  # transformers rounds to the dtype before the weight
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + offs, (w * normed).to(x.dtype), mask=ok)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    gate = tl.load(gate_up_ptr + row * 2 * inter + offs, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * inter + inter + offs, mask=ok, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu's own rounding, then the product's
    tl.store(out_ptr + row * inter + offs, (silu * up).to(gate.dtype), mask=ok)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_xt, DIM: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    ok = offs < DIM
    half: tl.constexpr = DIM // 2
    swapped = tl.where(offs < half, offs + half, offs - half)  # rotate_half's [x2, x1]; sin carries the sign
    src = x_ptr + token * stride_xt + head * DIM
    x = tl.load(src + offs, mask=ok, other=0.0)
    xs = tl.load(src + swapped, mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * DIM + offs, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * DIM + offs, mask=ok, other=0.0).to(tl.float32)
    a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)  # x * cos, rounded as torch's product is
    b = (xs * sin).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + (token * heads + head) * DIM + offs, (a + b).to(x.dtype), mask=ok)


def _warps(block: int) -> int:
    return max(1, min(8, block // 512))


class TritonLayerOps(LayerOps):
    """One Triton launch per op for dense 16-bit rows; anything else (fp32, odd strides) takes the torch ops."""

    def __init__(self) -> None:
        self._torch = TorchLayerOps()

    @staticmethod
    def _rows(x: torch.Tensor) -> bool:
        return x.dtype in TRITON_DTYPES and x.dim() == 2 and x.is_contiguous()

    def _norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows, width = x.shape
        out = torch.empty_like(x)
        if rows == 0:
            return out
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(rows,)](x, x if delta is None else delta, weight, out, width, eps, ADD=delta is not None,
                                  BLOCK=block, num_warps=_warps(block))
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._rows(x) and weight.dtype == x.dtype and weight.is_contiguous():
            return self._norm(x, None, weight, eps)
        return self._torch.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rows(residual) and delta.is_contiguous() and delta.shape == residual.shape \
                and delta.dtype == weight.dtype == residual.dtype:
            return residual, self._norm(residual, delta, weight, eps)  # residual updated in place
        return self._torch.add_rms_norm(residual, delta, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self._rows(gate_up) or gate_up.shape[1] % 2:
            return self._torch.silu_and_mul(gate_up)
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
        if rows == 0:
            return out
        block = min(2048, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block,
                                                                  num_warps=_warps(block))
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        tokens, heads, dim = x.shape
        dense = x.dtype in TRITON_DTYPES and x.stride(2) == 1 and x.stride(1) == dim and dim % 2 == 0
        angles = cos.shape == signed_sin.shape == (tokens, 1, dim) and cos.is_contiguous() \
            and signed_sin.is_contiguous() and cos.dtype == signed_sin.dtype == x.dtype
        if not (dense and angles):
            return self._torch.rope(x, cos, signed_sin)
        out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
        if tokens == 0:
            return out
        _rope_kernel[(tokens, heads)](x, cos, signed_sin, out, heads, x.stride(0), DIM=dim,
                                      BLOCK=triton.next_power_of_2(dim), num_warps=1)
        return out
