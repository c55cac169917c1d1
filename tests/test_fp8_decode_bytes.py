"""Native decode attention reads every FP8 byte value exactly (kernels/cpu/kv_dot.h's kv_row16: the bits moved into an
fp16 and widened, a power of two folded into the query and V factors), in each tier's code (AVX-512, AVX2 + F16C,
portable C), subnormals included.

V: a one-key row's output is its V row times the V scale, so fp32 queries give torch's `v.float() * scale` bit for
bit. K: a row over a zero key and a key holding one byte value under a one-hot query weighs that key by
sigmoid(q * k), which a flushed subnormal or a wrong power of two moves far past the tolerance."""

from __future__ import annotations

import ctypes

import pytest
import torch

import cpu_tiers
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.structs import DecodeArgs
from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype

DIM, BLOCK = 64, 16
# One query weight per format, putting the smallest subnormal's score near 0.5 (2^-9 for e4m3, 2^-16 for e5m2).
QUERY = {KVDtype.FP8_E4M3: 256.0, KVDtype.FP8_E5M2: 32768.0}


def finite_bytes(kv_dtype: KVDtype) -> torch.Tensor:
    values = torch.arange(256, dtype=torch.uint8)
    return values[values.view(kv_dtype.torch_dtype).float().isfinite()]


def attend(tier: str, kv_dtype: KVDtype, k: torch.Tensor, v: torch.Tensor, query: torch.Tensor,
           seq_len: int, k_scale: float, v_scale: float) -> torch.Tensor:
    """Row i over its own block whose first seq_len slots hold k[i], v[i] ([rows, seq_len, DIM] bytes); one head."""
    rows = k.shape[0]
    layer = KVCache(KVCacheSpec(1, 1, DIM, BLOCK, kv_dtype), rows, torch.device("cpu")).layers[0]
    layer.k.view(torch.uint8)[:, :seq_len, 0] = k
    layer.v.view(torch.uint8)[:, :seq_len, 0] = v
    layer.k_scale.fill_(k_scale), layer.v_scale.fill_(v_scale)
    batch = cpu_native.DecodeBatch(torch.arange(rows), torch.full((rows,), seq_len, dtype=torch.int32),
                                   torch.arange(rows, dtype=torch.int32)[:, None].contiguous(), seq_len)
    out = torch.zeros_like(query)
    args = DecodeArgs(**cpu_native.attention_fields(query, out, layer, batch, 1.0))
    assert cpu_native.load_library(tier).pagedserve_decode_attention(ctypes.byref(args), rows, seq_len, 1) == 0
    return out


@pytest.mark.parametrize("tier", cpu_tiers.params(cpu_tiers.CORE))
@pytest.mark.parametrize("kv_dtype", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_every_fp8_byte_reads_exactly(tier: str, kv_dtype: KVDtype) -> None:
    values = finite_bytes(kv_dtype)
    n = len(values)
    # V: every byte once, spread over rows of DIM lanes (the last row padded with zeros)
    v = torch.zeros(-(-n // DIM) * DIM, dtype=torch.uint8)
    v[:n] = values
    v = v.view(-1, 1, DIM)
    query = torch.randn(v.shape[0], 1, DIM, generator=torch.Generator().manual_seed(0))
    out = attend(tier, kv_dtype, torch.zeros_like(v), v, query, 1, 1.0, 0.3)
    expected = v[:, 0].view(kv_dtype.torch_dtype).float() * torch.tensor(0.3)
    assert torch.equal(out[:, 0], expected)

    # K: row i sees a zero key and a key holding byte values[i] at lane i % DIM, under the one-hot query there
    lanes = torch.arange(n) % DIM
    k = torch.zeros(n, 2, DIM, dtype=torch.uint8)
    k[torch.arange(n), 1, lanes] = values
    ones = torch.tensor(1.0).to(kv_dtype.torch_dtype).view(torch.uint8)
    v = torch.zeros(n, 2, DIM, dtype=torch.uint8)
    v[:, 1] = ones
    query = torch.zeros(n, 1, DIM)
    query[torch.arange(n), 0, lanes] = QUERY[kv_dtype]
    out = attend(tier, kv_dtype, k, v, query, 2, 0.5, 1.0)
    key = values.view(kv_dtype.torch_dtype).double() * 0.5 * QUERY[kv_dtype]
    assert (out[:, 0].double() - torch.sigmoid(key)[:, None]).abs().max().item() <= 1e-6
