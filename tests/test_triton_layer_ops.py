"""The "triton" layer ops (kernels/triton_layer_ops.py) against the torch ops they replace on 16-bit CUDA models.

Without CUDA, conftest sets TRITON_INTERPRET=1 and the kernels run under Triton's CPU interpreter. Each kernel rounds
where torch's op order rounds, so the outputs are torch's up to the RMS sum's order: SiLU-and-mul and RoPE must equal
torch's in nearly every element, RMSNorm within one rounding of the dtype. tests/gpu/test_interpreter_cases_gpu.py
runs these compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model

from pagedserve.kernels.backends import LAYER_OPS, select_layer_ops
from pagedserve.kernels.layer_ops import TorchLayerOps

if "triton" not in LAYER_OPS:
    pytest.skip("triton is not installed", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, torch.bfloat16]
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
# Triton's interpreter casts fp32 to bf16 by truncation (a GPU rounds to nearest, as torch does): there bf16 results
# may sit a unit or two of the last place off torch's at each rounding, and need not match exactly.
TRUNCATED_BF16 = DEVICE.type == "cpu"


def _ops():
    return LAYER_OPS.get("triton")(), TorchLayerOps()


def _rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


def _close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, exact_share: float) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if dtype == torch.bfloat16 and TRUNCATED_BF16:  # a few units of the last place of the largest value
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(ours.float(), ref.float(), rtol=4 * ULP[dtype], atol=4 * ULP[dtype] * scale)
        return
    torch.testing.assert_close(ours.float(), ref.float(), rtol=ULP[dtype], atol=ULP[dtype] * 1e-2)
    same = (ours == ref).float().mean().item()
    assert same >= exact_share, f"only {same:.3f} of the elements equal torch's"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(5, 96), (1, 2048), (3, 300)])  # 300: a block wider than the row
def test_rms_norm_and_the_residual_add_match_torch(dtype, rows, width):
    ours, ref = _ops()
    x, delta = _rand(rows, width, dtype=dtype, seed=1, scale=3), _rand(rows, width, dtype=dtype, seed=2)
    weight = _rand(width, dtype=dtype, seed=3)
    _close(ours.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6), dtype, 0.95)
    want_total, want_normed = ref.add_rms_norm(x.clone(), delta, weight, 1e-5)
    residual = x.clone()
    total, normed = ours.add_rms_norm(residual, delta, weight, 1e-5)
    assert total is residual  # the residual stream, updated in place
    _close(residual, want_total, dtype, 1.0)
    _close(normed, want_normed, dtype, 0.95)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(4, 300), (1, 4096), (2, 2100)])  # 2100: two column blocks a row
def test_silu_and_mul_matches_torch(dtype, rows, inter):
    ours, ref = _ops()
    gate_up = _rand(rows, 2 * inter, dtype=dtype, seed=4, scale=4)
    _close(ours.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), dtype, 0.99)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_torch_on_dense_and_strided_heads(dtype):
    ours, ref = _ops()
    tokens, heads, dim = 3, 5, 64
    cos = _rand(tokens, 1, dim, dtype=dtype, seed=5)
    sin = _rand(tokens, 1, dim, dtype=dtype, seed=6)
    x = _rand(tokens, heads, dim, dtype=dtype, seed=7)
    _close(ours.rope(x, cos, sin), ref.rope(x, cos, sin), dtype, 0.99)
    qkv = _rand(tokens, (heads + 4) * dim, dtype=dtype, seed=8)  # q's heads as a view of a fused projection
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    assert not q.is_contiguous()
    _close(ours.rope(q, cos, sin), ref.rope(q, cos, sin), dtype, 0.99)


def test_what_the_kernels_do_not_take_goes_to_torch_and_auto_picks_them_for_16_bit_cuda():
    ours, ref = _ops()
    x = _rand(3, 4, 32, dtype=torch.float32, seed=9)
    weight = _rand(32, dtype=torch.float32, seed=10)
    assert torch.equal(ours.rms_norm(x.view(-1, 32), weight, 1e-6), ref.rms_norm(x.view(-1, 32), weight, 1e-6))
    half = x.half()
    assert torch.equal(ours.rms_norm(half, weight.half(), 1e-6), ref.rms_norm(half, weight.half(), 1e-6))  # 3-D
    assert torch.equal(ours.silu_and_mul(half[:, 0, :]), ref.silu_and_mul(half[:, 0, :]))  # strided rows
    empty = torch.empty(0, 64, dtype=torch.float16, device=DEVICE)
    assert ours.rms_norm(empty, torch.ones(64, dtype=torch.float16, device=DEVICE), 1e-6).shape == (0, 64)
    cuda = torch.device("cuda")
    assert type(select_layer_ops("auto", cuda, torch.bfloat16)).__name__ == "TritonLayerOps"
    assert type(select_layer_ops("auto", cuda, torch.float16)).__name__ == "TritonLayerOps"
    assert isinstance(select_layer_ops("auto", cuda, torch.float32), TorchLayerOps)  # fp32: transformers' bits


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("layer-ops-llama"), max_position_embeddings=256,
                           initializer_range=0.1)


def test_engine_with_triton_layer_ops_generates_torch_ops_tokens(tiny_llama):
    """An fp16 engine through the Triton attention and layer ops gives the greedy tokens of the same engine on the
    torch layer ops (the kernels round where torch rounds)."""
    from pagedserve.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 13, 21, 7], [3, 4, 5], [11] * 9]
    tokens = {}
    for ops in ("triton", "torch"):
        llm = LLM(str(tiny_llama), device=str(DEVICE), attention_backend="triton", layer_ops=ops, dtype="float16",
                  kv_cache_memory=1 << 22, max_num_seqs=4, enforce_eager=True)
        assert type(llm.engine.runner.layer_ops).__name__ == ("TritonLayerOps" if ops == "triton" else "TorchLayerOps")
        tokens[ops] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
