"""The fused C layer ops (kernels/cpu/layer_ops.c) against transformers' op order in torch (TorchLayerOps).

In 16-bit dtypes every rounding step is reproduced, so RoPE and SiLU-and-mul match torch exactly or within one
unit in the last place, and RMSNorm within one unit (its fp32 sum runs in another order). The model-level test runs
the default model in bf16 and fp32 with each set of ops and compares the logits at every position.
"""

from __future__ import annotations

import pytest
import torch

import cpu_tiers
from pagedserve.kernels.backends import select_layer_ops
from pagedserve.kernels.cpu.native import load_library
from pagedserve.kernels.cpu.layer_ops import NativeLayerOps
from pagedserve.kernels.layer_ops import TorchLayerOps
from pagedserve.kernels.cpu import layer_ops as cpu_layer_ops

CPU = torch.device("cpu")
TORCH, NATIVE = TorchLayerOps(), NativeLayerOps()
# One unit in the last place at |x| < 8 (bf16 keeps 8 significant bits, fp16 11); fp32: a few ulps, relative.
ULP_AT_8 = {torch.bfloat16: 2.0**-5, torch.float16: 2.0**-8}


def _inputs(rows: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    err = (a.float() - b.float()).abs()
    if dtype == torch.float32:
        assert (err <= 1e-6 * (b.abs() + 1)).all(), f"max abs err {err.max().item()}"
        return
    assert err.max().item() <= ULP_AT_8[dtype], f"max abs err {err.max().item()}"
    assert (err > 0).float().mean().item() < 0.02  # off-by-one-ulp results are rare, not the rule


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_rms_norm(dtype: torch.dtype, rows: int) -> None:
    x, weight = _inputs(rows, 576, dtype), _inputs(1, 576, dtype, seed=1)[0]
    _close(cpu_layer_ops.rms_norm(x, weight, 1e-5), TORCH.rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_rms_norm_updates_the_residual_in_place(dtype: torch.dtype) -> None:
    residual, delta, weight = _inputs(64, 576, dtype), _inputs(64, 576, dtype, 1), _inputs(1, 576, dtype, 2)[0]
    want_sum, want_norm = TORCH.add_rms_norm(residual, delta, weight, 1e-6)
    stream = residual.clone()
    got_sum, got_norm = NATIVE.add_rms_norm(stream, delta, weight, 1e-6)
    assert got_sum is stream and torch.equal(stream, want_sum)  # the add is rounded exactly as torch rounds it
    _close(got_norm, want_norm, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gate_up = _inputs(64, 2 * 1536, dtype) * 4  # gates far into both tails of the sigmoid
    _close(cpu_layer_ops.silu_and_mul(gate_up), TORCH.silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("tier", cpu_tiers.params(("native", "avx2", "avx512", "portable")))
def test_silu_of_every_bf16_gate(tier: str) -> None:
    """bf16 SiLU is a lookup in a table of every bf16 input's result (layer_ops.c, ps_silu_bf16): all 65,536 gates,
    NaN and infinities included, within one bf16 unit of torch's, at every tier (AVX-512 gathers, others index)."""
    gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(64, 1024)
    ups = _inputs(64, 1024, torch.bfloat16, seed=3)
    gate_up = torch.cat([gates, ups], dim=1).contiguous()
    got = cpu_layer_ops.silu_and_mul(gate_up, lib=load_library(None if tier == "native" else tier)).float()
    want = TORCH.silu_and_mul(gate_up).float()
    assert torch.equal(got.isnan(), want.isnan())
    finite = want.isfinite() & got.isfinite()
    assert torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()])
    # e^g flushes to 0 below g = -87 (exp16_nonpositive), where silu(g) is under 1e-35 anyway
    assert ((got - want)[finite].abs() <= torch.maximum(want[finite].abs() * 2.0**-7, torch.tensor(1e-35))).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_on_a_strided_slice(dtype: torch.dtype) -> None:
    """The model rotates q and k as one slice of the fused q/k/v output: rows strided, heads dense."""
    from pagedserve.engine.models.layers import RotaryEmbedding

    tokens, heads, dim = 37, 12, 64
    qkv = _inputs(tokens, (heads + 3) * dim, dtype).view(tokens, heads + 3, dim)
    q_and_k = qkv[:, :heads]
    angles = RotaryEmbedding(dim, 512, 10000.0, None).angles(torch.arange(100, 100 + tokens), dtype, TORCH)
    want = TORCH.rope(q_and_k, angles.cos, angles.signed_sin)
    got = cpu_layer_ops.rope(q_and_k, angles.cos, angles.signed_sin)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)  # torch rounds every bf16 op through fp32 on every x86 ISA, as we do
    elif dtype == torch.float16:
        # On CPUs with native fp16 arithmetic (AVX512-FP16, e.g. Sapphire Rapids) torch's fp16 kernels round
        # q*cos + rot(q)*sin in fp16 directly (one rounding fewer than our fp32-then-round steps), so results
        # may differ by one unit in the last place there; on AVX2/AVX512F hosts they are bit-identical.
        assert (got.float() - want.float()).abs().max().item() <= ULP_AT_8[dtype]
    else:
        assert (got - want).abs().max().item() < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_widths_off_the_16_lane_grid_take_the_scalar_loops(dtype: torch.dtype) -> None:
    """RMSNorm over 100 lanes, SiLU-and-mul over 50 (3 vectors + 2 lanes), RoPE at head_dim 40 (half of 20)."""
    from pagedserve.engine.models.layers import RotaryEmbedding

    x, weight = _inputs(7, 100, dtype), _inputs(1, 100, dtype, seed=1)[0]
    _close(cpu_layer_ops.rms_norm(x, weight, 1e-5), TORCH.rms_norm(x, weight, 1e-5), dtype)
    gate_up = _inputs(7, 100, dtype, seed=2) * 4
    _close(cpu_layer_ops.silu_and_mul(gate_up), TORCH.silu_and_mul(gate_up), dtype)
    q = _inputs(7, 3 * 40, dtype, seed=3).view(7, 3, 40)
    angles = RotaryEmbedding(40, 512, 10000.0, None).angles(torch.arange(7), dtype, TORCH)
    want, got = TORCH.rope(q, angles.cos, angles.signed_sin), cpu_layer_ops.rope(q, angles.cos, angles.signed_sin)
    assert (got.float() - want.float()).abs().max().item() <= (ULP_AT_8[dtype] if dtype in ULP_AT_8 else 1e-6)


def test_bf16_rounding_keeps_denormal_results() -> None:
    """Products below fp32's normal range round to bf16 denormals as torch rounds them; the hardware conversion
    (vcvtneps2bf16) would flush them to zero, so vectors holding one take the portable rounding."""
    from pagedserve.engine.models.layers import RotaryEmbedding

    tokens, heads, dim = 8, 4, 64
    x = (_inputs(tokens, heads * dim, torch.float32) * 1e-38).to(torch.bfloat16).view(tokens, heads, dim)
    angles = RotaryEmbedding(dim, 512, 10000.0, None).angles(torch.arange(tokens), torch.bfloat16, TORCH)
    want = TORCH.rope(x, angles.cos, angles.signed_sin)
    got = cpu_layer_ops.rope(x, angles.cos, angles.signed_sin)
    tiny = want.float().abs()
    assert ((tiny > 0) & (tiny < torch.finfo(torch.float32).tiny)).any()  # the case is really exercised
    assert torch.equal(got, want)


def test_auto_selection() -> None:
    assert type(select_layer_ops("auto", CPU, torch.bfloat16)) is NativeLayerOps
    assert type(select_layer_ops("auto", CPU, torch.float16)) is NativeLayerOps
    # fp32 too: greedy tokens still equal transformers' (test_engine_vs_transformers runs fp32 with these ops).
    assert type(select_layer_ops("auto", CPU, torch.float32)) is NativeLayerOps
    assert type(select_layer_ops("torch", CPU, torch.bfloat16)) is TorchLayerOps


def test_unsupported_inputs_take_the_torch_ops() -> None:
    x = _inputs(8, 64, torch.bfloat16).t()  # not contiguous
    weight = _inputs(1, 8, torch.bfloat16)[0]
    assert torch.equal(NATIVE.rms_norm(x, weight, 1e-5), TORCH.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype, max_relative, min_agree", [
    (torch.bfloat16, 2e-2, 0.95),  # bf16 rounding of every activation: near-ties may flip
    (torch.float32, 1e-5, 1.0),  # fp32: the same predictions at every position
])
def test_default_model_logits_match_the_torch_ops(default_model, dtype, max_relative, min_agree) -> None:
    """Every position of two prompts, through all 30 layers: the fused ops change no prediction that isn't a tie."""
    from quant_fixtures import full_logits, load

    loaded = load(default_model.weights, dtype)
    ids = torch.randint(100, 49000, (2, 48), generator=torch.Generator().manual_seed(0))
    torch_logits = full_logits(loaded, ids, layer_ops=TORCH)
    native_logits = full_logits(loaded, ids, layer_ops=NATIVE)
    relative = (native_logits - torch_logits).norm() / torch_logits.norm()
    assert relative.item() < max_relative
    agree = (native_logits.argmax(-1) == torch_logits.argmax(-1)).float().mean().item()
    assert agree >= min_agree
