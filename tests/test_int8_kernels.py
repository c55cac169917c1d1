"""The int8 KV cache's kernels (one fp16 scale per token and KV head): the quantization rule against numpy, and every
kernel against the torch reference (Triton under the interpreter on CPU, the native C kernels), bit for bit where
they store and within float64 math where they attend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attention_cases import BATCHES, DEVICE, SCALE, TOLERANCE, assert_matches_torch, float64_reference, make_case, \
    poison_stale_slots
from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.kernels.backends import ATTENTION_IMPLS, select_attention_impl
from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype
from pagedserve.kernels.kv_quant import quantize_rows_int8
from pagedserve.kernels.native_attention import NativeCpuAttention
from pagedserve.kernels.paged_attention import paged_attention, write_kv

triton_only = pytest.mark.skipif("triton" not in ATTENTION_IMPLS, reason="triton is not installed")


def numpy_int8_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documented rule, written independently: scale = fp16(amax / 127), q = clamp(rint(x / scale), +-127)."""
    x = x.astype(np.float32)
    scale = np.minimum(np.abs(x).max(axis=-1) / np.float32(127), np.float32(65504)).astype(np.float16)
    divisor = scale.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(divisor > 0, np.rint(x / divisor), 0)
    return np.clip(q, -127, 127).astype(np.int8), scale


def test_row_quantization_matches_numpy_and_stays_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 72, generator=gen) * torch.logspace(-6, 3, 50).view(-1, 1, 1)
    x[0] = 0.0  # a zero row: scale 0, zeros
    x[1, 0, :3] = torch.tensor([1e9, -1e9, 5.0])  # past fp16's scales: saturates, never inf
    x[2, 1] = torch.arange(72) - 36.0 + 0.5  # ties
    q, s = quantize_rows_int8(x)
    ref_q, ref_s = numpy_int8_rows(x.numpy())
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (50, 3)
    assert np.array_equal(q.numpy(), ref_q) and np.array_equal(s.numpy(), ref_s)
    assert torch.isfinite(s).all() and (q.abs() <= 127).all()
    back = q.float() * s.float().unsqueeze(-1)
    fits = x.abs().amax(-1) < 127 * 65504
    err = (back - x).abs()[fits & (s.float() > 6.2e-5)]  # normal fp16 scales: within half a step of the row
    step = s.float().unsqueeze(-1).expand_as(x)[fits & (s.float() > 6.2e-5)]
    assert (err <= 0.5 * step * (1 + 2**-10) + 1e-30).all()


# --- kernels against the torch reference --------------------------------------------------------------------------

@triton_only
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(3, 64, 16), (2, 72, 32), (1, 40, 16)])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_triton_write_is_bit_exact(num_kv_heads: int, head_dim: int, block_size: int, input_dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    num_blocks = 5
    key, value = (torch.randn(37, num_kv_heads, head_dim, generator=gen).to(input_dtype) for _ in range(2))
    key[0] = 0.0
    key[1, 0, :8] = torch.tensor([127.0, 63.5, -0.5, 1.5, 2.5, -2.5, 31.75, 0.25]).to(input_dtype)  # ties
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:37]
    slots[5] = -1  # padding: nothing written
    layers = []
    for impl in (select_attention_impl("torch", torch.device("cpu")), ATTENTION_IMPLS.get("triton")()):
        layer = KVCache(KVCacheSpec(1, num_kv_heads, head_dim, block_size, KVDtype.INT8), num_blocks, DEVICE).layers[0]
        keep = slots >= 0 if impl.__class__.__name__ == "TorchAttention" else slice(None)  # torch has no padding
        write_kv(impl, key[keep].to(DEVICE), value[keep].to(DEVICE), layer, slots[keep].to(DEVICE))
        layers.append(layer)
    ref, out = layers
    for name in ("k", "v", "k_row_scale", "v_row_scale"):
        assert torch.equal(getattr(ref, name).cpu(), getattr(out, name).cpu()), name


@triton_only
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize(("queries_per_kv", "block_size", "head_dim"), [(1, 16, 64), (3, 32, 64), (4, 16, 72)])
def test_triton_attention_matches_torch(batch: str, queries_per_kv: int, block_size: int, head_dim: int) -> None:
    seq_lens, query_lens = BATCHES[batch]
    query, layer, meta = make_case(seq_lens, query_lens, block_size, queries_per_kv, KVDtype.INT8, head_dim=head_dim)
    assert_matches_torch(ATTENTION_IMPLS.get("triton")(), query, layer, meta)


@triton_only
def test_triton_attention_with_rotated_keys() -> None:
    """The engine's int8 layout: K rotated by the Hadamard matrix on write, Q on attention (the entry points)."""
    seq_lens, query_lens = BATCHES["mixed"]
    query, layer, meta = make_case(seq_lens, query_lens, 16, 3, KVDtype.INT8, seed=4, rotate=True)
    assert_matches_torch(ATTENTION_IMPLS.get("triton")(), query, layer, meta)


@triton_only
def test_triton_attention_ignores_stale_int8_slots_and_agrees_with_float64() -> None:
    seq_lens, query_lens = BATCHES["mixed"]
    query, layer, meta = make_case(seq_lens, query_lens, 16, 3, KVDtype.INT8, seed=2)
    exact = float64_reference(query, layer, meta)
    poison_stale_slots(layer, meta)
    result = paged_attention(ATTENTION_IMPLS.get("triton")(), query, layer, meta, SCALE)
    assert torch.isfinite(result).all()
    assert (result.double().cpu() - exact).abs().max().item() <= TOLERANCE[query.dtype]


def test_torch_path_agrees_with_float64_math() -> None:
    seq_lens, query_lens = BATCHES["mixed"]
    query, layer, meta = make_case(seq_lens, query_lens, 16, 3, KVDtype.INT8, seed=2)
    exact = float64_reference(query, layer, meta)
    result = paged_attention(select_attention_impl("torch", DEVICE), query, layer, meta, SCALE)
    assert (result.double().cpu() - exact).abs().max().item() <= TOLERANCE[query.dtype]


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize(("queries_per_kv", "block_size", "head_dim"),
                         [(1, 8, 64), (3, 16, 64), (4, 32, 128), (3, 16, 72), (2, 16, 48)])
def test_native_attention_matches_torch(batch: str, queries_per_kv: int, block_size: int, head_dim: int) -> None:
    """Decode (vector code at multiples of 16, the scalar code at 72) and prefill (C for multiples of 16)."""
    seq_lens, query_lens = BATCHES[batch]
    query, layer, meta = make_case(seq_lens, query_lens, block_size, queries_per_kv, KVDtype.INT8, head_dim=head_dim)
    assert_matches_torch(NativeCpuAttention(), query, layer, meta)


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
def test_native_prefill_and_decode_agree_with_float64(query_dtype) -> None:
    """Chunks longer than the C prefill's 16-position tiles starting mid-block after cached context, 2-token chunks
    and decode rows, in the compute dtypes the engine uses (bf16 takes the AVX512-BF16 path where the CPU has it)."""
    seq_lens, query_lens = (300, 77, 129, 40, 200), (300, 50, 2, 37, 1)
    query, layer, meta = make_case(seq_lens, query_lens, 16, 3, KVDtype.INT8, head_dim=64, seed=8)
    query = query.to(query_dtype)
    impl = NativeCpuAttention()
    assert impl.plan(meta, layer).prefill is not None  # the C kernel, not SDPA
    exact = float64_reference(query, layer, meta)
    result = paged_attention(impl, query, layer, meta, SCALE)
    # fp32: prefill rows within fp32 noise; decode rows also round each probability times its V row scale to int16
    # (2^-16 of a key chunk's largest, kernels/cpu/kv_values.h; modelled exactly in tests/test_int8_decode_dots.py):
    # a few 1e-5 here, against int8's own ~4e-3 of each V row
    decode = torch.repeat_interleave(torch.tensor([q == 1 for q in query_lens]), torch.tensor(query_lens))
    error = (result.double() - exact).abs()
    if query_dtype == torch.float32:
        assert error[~decode].max().item() <= 1e-5 and error[decode].max().item() <= 1e-4
    else:
        assert error.max().item() <= 1.6e-2
    poison_stale_slots(layer, meta)
    assert torch.equal(paged_attention(impl, query, layer, meta, SCALE), result)  # stale NaN rows never read


@pytest.mark.parametrize("kv_dtype", [KVDtype.INT8, KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_native_kernels_widen_every_8_bit_value_exactly(kv_dtype: KVDtype) -> None:
    """One cached token: decode attention's output is its V row, dequantized. Every byte value (finite FP8 ones,
    subnormals included; -127..127 for int8) in one 256-wide row must come back exactly as torch converts it."""
    layer = KVCache(KVCacheSpec(1, 1, 256, 16, kv_dtype), 2).layers[0]
    raw = torch.arange(256, dtype=torch.int32)
    if kv_dtype is KVDtype.INT8:
        raw = raw.clamp(max=254) - 127
        layer.v_row_scale.fill_(0.5)
        layer.k_row_scale.fill_(1.0)
    elif kv_dtype is KVDtype.FP8_E4M3:
        raw = torch.where((raw & 0x7F) == 0x7F, 0, raw)  # NaN bytes: never stored
    else:
        raw = torch.where((raw & 0x7C) == 0x7C, 0, raw)  # inf and NaN bytes
    layer.v.view(torch.uint8)[0, 0, 0] = raw.to(torch.uint8)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([1], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32), slot_mapping=torch.zeros(1, dtype=torch.int64),
        max_query_len=1, max_seq_len=1, query_lens_host=(1,), seq_lens_host=(1,))
    out = paged_attention(NativeCpuAttention(), torch.randn(1, 1, 256), layer, meta, SCALE)
    expected = layer.v[0, 0, 0].float() * (0.5 if kv_dtype is KVDtype.INT8 else 1.0)
    assert torch.equal(out[0, 0], expected)


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_write_is_bit_exact(input_dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    key, value = (torch.randn(29, 3, 64, generator=gen).to(input_dtype) for _ in range(2))
    key[0] = 0.0
    key[1, 0, :6] = torch.tensor([127.0, 63.5, -0.5, 1.5, 2.5, -2.5]).to(input_dtype)
    if input_dtype != torch.float16:  # a row past fp16's scale range saturates (the scale stops at 65504)
        value[2, 1] = value[2, 1] * 1e8
        value[2, 1, 5] = 1e12  # a quotient past 2^22 (rounding by adding 1.5 * 2^23 no longer exact: clamped)
    slots = torch.randperm(6 * 16, generator=gen)[:29]
    layers = []
    for impl in (select_attention_impl("torch", torch.device("cpu")), NativeCpuAttention()):
        layer = KVCache(KVCacheSpec(1, 3, 64, 16, KVDtype.INT8), 6).layers[0]
        write_kv(impl, key, value, layer, slots)
        layers.append(layer)
    for name in ("k", "v", "k_row_scale", "v_row_scale"):
        assert torch.equal(getattr(layers[0], name), getattr(layers[1], name)), name
    with pytest.raises(IndexError):
        write_kv(NativeCpuAttention(), key[:1], value[:1], layers[0], torch.tensor([6 * 16]))
