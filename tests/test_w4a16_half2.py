"""The split-K GEMV's half2 one-row variant (quant/w4a16_half2.py: 4-bit codes two at a time in fp16) against the
dequantized fp32 reference, under Triton's interpreter without CUDA (conftest sets TRITON_INTERPRET=1; the variant's
PTX is emulated there in the same fp16 arithmetic; tests/test_w4a16_compile.py checks the PTX's machine code, and
tests/gpu/test_w4a16_gpu.py runs it on a device through the bench sweep's half2 launches).
"""

from __future__ import annotations

import pytest
import torch

from quant_fixtures import random_weight

from test_w4a16 import DEVICE, TOLERANCE, _on

w4a16_kernel = pytest.importorskip("pagedserve.quant.w4a16_kernel", reason="triton is not installed")


@pytest.mark.parametrize("bits,k,n,group,act_order", [
    (4, 320, 72, 64, True), (4, 200, 40, -1, False), (4, 208, 96, 48, True), (8, 208, 96, 48, True),
    (4, 1024, 24, 128, False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_splitk_half2_matches_reference(bits, k, n, group, act_order, dtype):
    """The one-row variant that takes 16-bit activations and 4-bit codes two at a time in fp16 (w4a16_half2.py; the
    interpreter emulates its PTX; bf16 activations converted to fp16): act-order, partial and odd groups (48: 16-row
    spans, one word per fp16 sum), one group, many spans; 8 bits and fp32 take the fp32 path. fp16 products and sums
    of 16 codes cost precision: within the fp16 tolerance all the same (about half of it on the first shape)."""
    from pagedserve.quant import w4a16_splitk

    w = random_weight(k, n, bits, group, act_order, seed=k + n + bits)
    kernel = w4a16_kernel.W4A16Kernel(_on(w, DEVICE))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    ref = x.float() @ w.dequantize(torch.float32).t()
    for block_n in (32, 64):
        y = kernel.splitk(x.to(DEVICE), w4a16_splitk.SplitKConfig(block_n=block_n, unpack=True, half2=True))
        assert (y.float().cpu() - ref).abs().max().item() <= TOLERANCE[dtype] * ref.abs().max().item()
    assert not kernel.workspace().sums.any() and not kernel.workspace().counts.any()


def test_splitk_half2_fp16_sums_stay_finite_for_large_activations():
    """|x| up to 4096: fp16 sums of 8 products x (q - z) would pass fp16's 65504 (up to 15 x each); the variant sums
    x (q - z) / 16 (exact dequantization, scaled back by 16 in fp32), so they stay finite and accurate."""
    from pagedserve.quant import w4a16_splitk

    w = random_weight(256, 64, 4, 128, True, seed=5)
    kernel = w4a16_kernel.W4A16Kernel(_on(w, DEVICE))
    x = ((torch.rand(1, 256, generator=torch.Generator().manual_seed(3)) * 2 - 1) * 4096).half()
    ref = x.float() @ w.dequantize(torch.float32).t()
    y = kernel.splitk(x.to(DEVICE), w4a16_splitk.SplitKConfig(block_n=32, unpack=True, half2=True)).float().cpu()
    assert torch.isfinite(y).all()
    assert (y - ref).abs().max().item() <= TOLERANCE[torch.float16] * ref.abs().max().item()
    with pytest.raises(ValueError, match="choose one"):
        w4a16_splitk.SplitKConfig(half2=True, in_place=True)


def test_splitk_half2_takes_the_fp32_path_for_an_activation_two_bytes_off_alignment():
    """The variant reads sorted activations as int32 pairs; a row viewed 2 bytes into its storage would fault on a
    GPU (the interpreter reads it unaligned), so it takes the fp32 path, and still matches the reference; as do fp32
    activations and 8-bit codes."""
    from pagedserve.quant import w4a16_half2, w4a16_splitk

    w = random_weight(256, 48, 4, 128, False, seed=11)
    kernel = w4a16_kernel.W4A16Kernel(_on(w, DEVICE))
    base = torch.randn(257, generator=torch.Generator().manual_seed(4)).half().to(DEVICE)
    x = base[1:].view(1, 256)
    assert x.data_ptr() % 4 == 2 and x.is_contiguous()
    assert not w4a16_half2.half2_takes(x, 4) and w4a16_half2.half2_takes(base[:256].view(1, 256), 4)
    assert w4a16_half2.half2_takes(x.bfloat16(), 4) and not w4a16_half2.half2_takes(x.float(), 4)
    assert not w4a16_half2.half2_takes(base[:256].view(1, 256), 8)
    ref = x.float().cpu() @ w.dequantize(torch.float32).t()
    y = kernel.splitk(x, w4a16_splitk.SplitKConfig(block_n=32, unpack=True, half2=True)).float().cpu()
    assert (y - ref).abs().max().item() <= TOLERANCE[torch.float16] * ref.abs().max().item()
