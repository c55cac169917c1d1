"""Every RoPE scaling's table against transformers' own ROPE_INIT_FUNCTIONS (fp32, bit for bit where the op order
is the same), LongRoPE's row choice by sequence length, and vLLM's fixed-base dynamic NTK."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.errors import ModelLoadError
from pagedserve.engine.models.rope import RotaryEmbedding, hf_rope, inv_freqs

HEAD, MAX_POS = 32, 8192
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn-betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024, "beta_fast": 16,
                   "beta_slow": 2, "truncate": False},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(HEAD // 2)],
                 "long_factor": [1.0 + 2.0 * i for i in range(HEAD // 2)], "original_max_position_embeddings": 2048},
}


def _transformers(scaling: dict, seq_len: int | None = None, **extra) -> tuple[torch.Tensor, float]:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=HEAD * 4, num_attention_heads=4, head_dim=HEAD,
                                   max_position_embeddings=MAX_POS, rope_parameters={**scaling, "rope_theta": 1e6},
                                   **extra)
    return ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_inverse_frequencies_equal_transformers(name):
    scaling = SCALINGS[name]
    params = hf_rope({"max_position_embeddings": MAX_POS}, rope={**scaling, "rope_theta": 1e6})
    ours, attention = inv_freqs(HEAD, params)
    theirs, their_attention = _transformers(scaling)
    assert torch.equal(ours[0], theirs) and attention == pytest.approx(their_attention, rel=1e-12)
    if name == "longrope":  # transformers' long set: what it computes for a sequence past the pretraining length
        long, _ = _transformers(scaling, seq_len=2049)
        assert torch.equal(ours[1], long) and not torch.equal(ours[0], ours[1])


def test_dynamic_ntk_is_vllms_fixed_base():
    """vLLM fixes the base for factor x max positions; transformers' dynamic frequencies at that length agree."""
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    params = hf_rope({"max_position_embeddings": MAX_POS}, rope={**scaling, "rope_theta": 1e6})
    ours, _ = inv_freqs(HEAD, params)
    theirs, _ = _transformers(scaling, seq_len=2 * MAX_POS)
    torch.testing.assert_close(ours[0], theirs, rtol=1e-6, atol=0)
    assert params.table_positions(MAX_POS) == 2 * MAX_POS


def test_longrope_rows_follow_each_sequence_length():
    params = hf_rope({"max_position_embeddings": MAX_POS}, rope={**SCALINGS["longrope"], "rope_theta": 1e6})
    rotary = RotaryEmbedding(HEAD, MAX_POS, params.theta, params.scaling)
    assert rotary.cos.shape == (2048 + MAX_POS, HEAD)  # short rows only up to the pretraining length
    positions = torch.tensor([5, 5, 2047])
    rows = rotary.table_rows(positions, torch.tensor([100, 3000, 2048]))
    assert rows.tolist() == [5, 2048 + 5, 2047]
    long, attention = _transformers(SCALINGS["longrope"], seq_len=2049)
    angles = torch.cat((5 * long, 5 * long))
    assert torch.equal(rotary.cos[2048 + 5], angles.cos() * attention) and attention > 1


def test_partial_rotary_turns_the_first_dimensions_only():
    rotary = RotaryEmbedding(HEAD, 64, 10000.0, None, partial_rotary_factor=0.5)
    from pagedserve.kernels.layer_ops import TorchLayerOps

    x = torch.randn(3, 2, HEAD)
    out = rotary.angles(torch.tensor([0, 7, 63]), torch.float32, TorchLayerOps()).rotate(x)
    assert rotary.cos.shape[1] == HEAD // 2 and torch.equal(out[..., HEAD // 2:], x[..., HEAD // 2:])
    assert not torch.equal(out[1:, :, : HEAD // 2], x[1:, :, : HEAD // 2])


def test_unknown_scaling_and_missing_fields_are_named():
    with pytest.raises(ModelLoadError, match="rope_type: unsupported 'mrope'.*yarn, longrope"):
        hf_rope({"max_position_embeddings": 10}, rope={"rope_type": "mrope"})
    with pytest.raises(ModelLoadError, match="rope_scaling.long_factor: missing"):
        hf_rope({"max_position_embeddings": 10}, rope={"rope_type": "longrope", "short_factor": [1.0]})
