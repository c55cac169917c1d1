"""The Triton PagedAttention kernel against the torch implementation (the CPU serving path) on identical caches.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton is
imported); with CUDA they compile and the same cases run on the GPU. Shapes stay small because the interpreter
executes every program instance in Python: the whole file takes well under a minute on 2 cores.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype, LayerKVCache  # noqa: E402
from pagedserve.kernels.kv_scales import hadamard  # noqa: E402
from pagedserve.kernels.paged_attention import (  # noqa: E402
    ATTENTION_IMPLS,
    AttentionMetadata,
    paged_attention,
    select_attention_impl,
    write_kv,
)
from pagedserve.kernels.torch_attention import dequantize_from_cache  # noqa: E402
from pagedserve.kernels.triton_backend import TritonAttention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_KV_HEADS = 2
SCALE = 0.125

# (seq_lens, query_lens): lengths 1 and exact multiples of both block sizes (32), partial blocks, and for the
# chunked-prefill rows new tokens that start mid-block after cached context.
BATCHES = {
    "decode": ((1, 32, 17, 45), (1, 1, 1, 1)),
    "prefill": ((1, 32, 7, 19), (1, 32, 7, 19)),
    "mixed": ((33, 32, 40, 1, 64), (1, 32, 8, 1, 21)),
}
# fp8 caches are read with fp16 queries: the reference dequantizes the very same fp8 bytes.
QUERY_DTYPES = {
    KVDtype.FP16: torch.float16,
    KVDtype.BF16: torch.bfloat16,
    KVDtype.FP8_E4M3: torch.float16,
    KVDtype.FP8_E5M2: torch.float16,
    KVDtype.FP32: torch.float32,
}
# One output rounding step apart at |out| < 4: fp16's spacing there is 2^-9 ~ 1.95e-3, bf16's is 8x coarser.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def make_case(
    seq_lens: tuple[int, ...], query_lens: tuple[int, ...], block_size: int, queries_per_kv: int,
    kv_dtype: KVDtype, head_dim: int = 64, seed: int = 0, rotate: bool = False,
) -> tuple[torch.Tensor, LayerKVCache, AttentionMetadata]:
    """A cache whose blocks are scattered in random order, filled with every token's K/V by the torch path."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used : used + n]
        used += n
    cache = KVCache(KVCacheSpec(1, NUM_KV_HEADS, head_dim, block_size, kv_dtype), num_blocks, DEVICE)
    cache.set_k_rotation(hadamard(head_dim) if rotate else None)
    if kv_dtype.is_fp8:
        k_scale, v_scale = (torch.rand(NUM_KV_HEADS, generator=gen) * 0.02 + 0.005 for _ in range(2))
        cache.set_scales(0, k_scale, v_scale)
    all_slots, new_slots = [], []
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        pos = torch.arange(seq_len)
        slots = tables[i, pos // block_size].long() * block_size + pos % block_size
        all_slots.append(slots)
        new_slots.append(slots[seq_len - q_len :])
    qdtype = QUERY_DTYPES[kv_dtype]
    total = sum(seq_lens)
    k, v = (torch.randn(total, NUM_KV_HEADS, head_dim, generator=gen).to(qdtype) for _ in range(2))
    layer = cache.layers[0]
    torch_impl = select_attention_impl("torch", torch.device("cpu"))
    write_kv(torch_impl, k.to(DEVICE), v.to(DEVICE), layer, torch.cat(all_slots).to(DEVICE))
    query = torch.randn(sum(query_lens), NUM_KV_HEADS * queries_per_kv, head_dim, generator=gen).to(qdtype)
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        slot_mapping=torch.cat(new_slots).to(DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return query.to(DEVICE), layer, meta


def float64_reference(query: torch.Tensor, layer: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
    """Plain per-sequence attention in float64 over the dequantized cache contents."""
    out = torch.empty(query.shape, dtype=torch.float64)
    block_size, queries_per_kv = layer.k.shape[1], query.shape[1] // layer.k.shape[2]
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        blocks = meta.block_tables[i, : -(-seq_len // block_size)].long()
        k, v = (
            dequantize_from_cache(c[blocks].flatten(0, 1)[:seq_len], s, layer.dtype, query.dtype)
            .double().cpu().repeat_interleave(queries_per_kv, 1)
            for c, s in ((layer.k, layer.k_scale), (layer.v, layer.v_scale))
        )
        q = query[start : start + q_len].double().cpu()
        scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
        hidden = torch.arange(seq_len)[None, :] > torch.arange(seq_len - q_len, seq_len)[:, None]
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, -torch.inf).softmax(-1), v)
        start += q_len
    return out


def run_both(query, layer, meta) -> tuple[torch.Tensor, torch.Tensor]:
    reference = paged_attention(select_attention_impl("torch", torch.device("cpu")), query, layer, meta, SCALE)
    result = paged_attention(ATTENTION_IMPLS.get("triton")(), query, layer, meta, SCALE)
    return reference, result


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("queries_per_kv", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_dtype", [KVDtype.FP16, KVDtype.BF16, KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_matches_torch_path(batch: str, queries_per_kv: int, block_size: int, kv_dtype: KVDtype) -> None:
    seq_lens, query_lens = BATCHES[batch]
    query, layer, meta = make_case(seq_lens, query_lens, block_size, queries_per_kv, kv_dtype)
    reference, result = run_both(query, layer, meta)
    assert result.dtype == query.dtype and result.shape == query.shape
    err = (result.float() - reference.float()).abs().max().item()
    assert err <= TOLERANCE[query.dtype], f"max abs err {err}"


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP16, KVDtype.FP8_E4M3, KVDtype.FP32])
def test_head_dim_128_and_fp32(kv_dtype: KVDtype) -> None:
    seq_lens, query_lens = BATCHES["mixed"]
    query, layer, meta = make_case(seq_lens, query_lens, 16, 4, kv_dtype, head_dim=128, seed=1)
    reference, result = run_both(query, layer, meta)
    assert (result.float() - reference.float()).abs().max().item() <= TOLERANCE[query.dtype]


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_with_hadamard_rotated_keys(kv_dtype: KVDtype) -> None:
    """The entry points rotate K on write and Q on attention; both implementations see the same rotated data."""
    seq_lens, query_lens = BATCHES["mixed"]
    query, layer, meta = make_case(seq_lens, query_lens, 16, 3, kv_dtype, seed=4, rotate=True)
    reference, result = run_both(query, layer, meta)
    assert (result.float() - reference.float()).abs().max().item() <= TOLERANCE[query.dtype]


def test_both_paths_agree_with_float64_math() -> None:
    """Guards against the kernel and the torch path sharing one mistake (e.g. the causal offset of a chunk)."""
    seq_lens, query_lens = BATCHES["mixed"]
    query, layer, meta = make_case(seq_lens, query_lens, 16, 3, KVDtype.FP32, seed=2)
    exact = float64_reference(query, layer, meta)
    for out in run_both(query, layer, meta):
        assert (out.double().cpu() - exact).abs().max().item() < 1e-5


def test_never_reads_past_seq_len() -> None:
    """Slots past each sequence's length (stale data of freed blocks) must not leak into the output, even NaNs."""
    seq_lens, query_lens = BATCHES["mixed"]
    query, layer, meta = make_case(seq_lens, query_lens, 16, 4, KVDtype.FP16, seed=3)
    reference, _ = run_both(query, layer, meta)
    num_blocks, block_size = layer.k.shape[:2]
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    for i, seq_len in enumerate(meta.seq_lens_host):
        pos = torch.arange(seq_len, device=DEVICE)
        written[meta.block_tables[i, pos // 16].long() * 16 + pos % 16] = True
    stale = ~written.view(num_blocks, block_size)
    layer.k[stale] = float("nan")  # boolean indexing writes through the cache's strided view
    layer.v[stale] = float("nan")
    result = paged_attention(ATTENTION_IMPLS.get("triton")(), query, layer, meta, SCALE)
    assert torch.isfinite(result).all()
    assert (result.float() - reference.float()).abs().max().item() <= TOLERANCE[torch.float16]


@pytest.mark.parametrize("block_size", [8])
def test_unsupported_block_size_is_refused_before_launch(block_size: int) -> None:
    query, layer, meta = make_case((5,), (5,), block_size, 1, KVDtype.FP16)
    with pytest.raises(ValueError, match="block_size"):
        paged_attention(ATTENTION_IMPLS.get("triton")(), query, layer, meta, SCALE)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from conftest import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_engine_generates_through_triton_like_the_torch_path(tiny_llama: str, kv_cache_dtype: str) -> None:
    """Greedy generation, token for token, with chunked prefills (16-token budget) mixed into decode steps."""
    from pagedserve.engine import LLM, SamplingParams

    prompts = [list(range(100, 130)), [400, 401, 402], [5, 17, 300, 42, 9, 1000, 77, 8, 123]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            tiny_llama, attention_backend=backend, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 22,
            max_num_batched_tokens=16, device=DEVICE.type,
        )
        impl = llm.engine.runner.attn_impl
        assert isinstance(getattr(impl, "inner", impl), TritonAttention) == (backend == "triton")
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 5 for t in tokens["torch"])
