"""The Triton kernels compiled on a real GPU: larger shapes, bit-exact FP8 writes, >2^31-element caches, the engine.

Marked `gpu` and skipped without CUDA. On a machine with CUDA, tests/conftest.py leaves TRITON_INTERPRET unset, so
these run compiled (`pytest -m gpu`). Throughput is measured by benchmarks/attention_kernel.py, not here.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

triton = pytest.importorskip("triton")

from pagedserve.kernels.attention import AttentionMetadata  # noqa: E402
from pagedserve.kernels.backends import ATTENTION_IMPLS, select_attention_impl  # noqa: E402
from pagedserve.kernels.kv_cache import KVCache, KVCacheSpec, KVDtype  # noqa: E402
from pagedserve.kernels.paged_attention import paged_attention, write_kv  # noqa: E402
from tiny_models import VOCAB, make_tiny  # noqa: E402

CUDA = torch.device("cuda")
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def compiled_kernels() -> None:
    from pagedserve.kernels.triton_backend import kernels_interpreted

    if kernels_interpreted():
        pytest.skip("TRITON_INTERPRET=1 in this process: run `pytest -m gpu tests/gpu` on its own")


def fp8_dtypes() -> list[KVDtype]:
    """e4m3 conversions need compute capability 8.9+ (Ada, Hopper); e5m2 works everywhere."""
    ok = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    return [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2] if ok else [KVDtype.FP8_E5M2]


def build(seq_lens, query_lens, block_size, num_kv_heads, queries_per_kv, head_dim, kv_dtype, qdtype, extra_blocks=0):
    """Random K/V written by the torch path into randomly ordered blocks, the last ones at the end of a big pool."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + extra_blocks
    order = torch.randperm(sum(per_seq), generator=gen) + extra_blocks  # highest block ids: largest offsets
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[start : start + n]
        start += n
    cache = KVCache(KVCacheSpec(1, num_kv_heads, head_dim, block_size, kv_dtype), num_blocks, CUDA)
    if kv_dtype.is_fp8:
        cache.set_scales(0, torch.rand(num_kv_heads, generator=gen) * 0.02 + 0.005, torch.rand(num_kv_heads, generator=gen) * 0.02 + 0.005)
    slots, new = [], []
    for i, (s, q) in enumerate(zip(seq_lens, query_lens)):
        pos = torch.arange(s)
        sl = tables[i, pos // block_size].long() * block_size + pos % block_size
        slots.append(sl)
        new.append(sl[s - q :])
    k, v = (torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=gen).to(qdtype).to(CUDA) for _ in range(2))
    layer = cache.layers[0]
    write_kv(select_attention_impl("torch", CUDA), k, v, layer, torch.cat(slots).to(CUDA))
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl.to(CUDA), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=CUDA),
        block_tables=tables.to(CUDA), slot_mapping=torch.cat(new).to(CUDA), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_lens_host=tuple(query_lens), seq_lens_host=tuple(seq_lens),
    )
    query = torch.randn(sum(query_lens), num_kv_heads * queries_per_kv, head_dim, generator=gen).to(qdtype).to(CUDA)
    return query, layer, meta


def check(query, layer, meta) -> None:
    scale = query.shape[-1] ** -0.5
    want = paged_attention(select_attention_impl("torch", CUDA), query, layer, meta, scale)
    got = paged_attention(ATTENTION_IMPLS.get("triton")(), query, layer, meta, scale)
    torch.cuda.synchronize()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOLERANCE[query.dtype], f"max abs err {err}"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("queries_per_kv", [1, 4, 8])
@pytest.mark.parametrize("kv_dtype", [KVDtype.FP16, KVDtype.BF16, KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_mixed_batch_matches_torch_path(kv_dtype, queries_per_kv, block_size, head_dim) -> None:
    if kv_dtype.is_fp8 and kv_dtype not in fp8_dtypes():
        pytest.skip("fp8_e4m3 needs compute capability 8.9+")
    qdtype = torch.bfloat16 if kv_dtype == KVDtype.BF16 else torch.float16
    seq_lens = (1, 512, 1000, 1537, 2048, 700, 64)
    query_lens = (1, 512, 1, 1, 300, 77, 1)  # prefills, decodes, and chunks after cached context
    check(*build(seq_lens, query_lens, block_size, 4, queries_per_kv, head_dim, kv_dtype, qdtype))


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP16, KVDtype.BF16, KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_writes_are_bit_exact_against_torch(kv_dtype) -> None:
    if kv_dtype.is_fp8 and kv_dtype not in fp8_dtypes():
        pytest.skip("fp8_e4m3 needs compute capability 8.9+")
    gen = torch.Generator(device="cpu").manual_seed(1)
    key, value = (torch.randn(999, 8, 128, generator=gen).mul(20).to(CUDA) for _ in range(2))
    key[0, 0, :3] = torch.tensor([1e9, -1e9, -31.07 * 0.01], device=CUDA)
    slots = torch.randperm(64 * 16, generator=gen)[:999].to(CUDA)
    caches = []
    for impl in (select_attention_impl("torch", CUDA), ATTENTION_IMPLS.get("triton")()):
        cache = KVCache(KVCacheSpec(1, 8, 128, 16, kv_dtype), 64, CUDA)
        cache.set_scales(0, torch.linspace(0.005, 0.05, 8), torch.linspace(0.05, 0.005, 8))
        write_kv(impl, key, value, cache.layers[0], slots)
        caches.append(cache.layers[0])
    for name in ("k", "v"):
        a, b = getattr(caches[0], name), getattr(caches[1], name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_cache_beyond_2_pow_31_elements_uses_64_bit_offsets() -> None:
    """Blocks past element 2^31 of one cache tensor: int32 offsets would wrap and read the wrong memory."""
    block_elems = 16 * 8 * 128
    extra = (2**31 // block_elems) + 64
    needed = 2 * (extra + 200) * block_elems  # fp8: one byte per element, K and V
    if torch.cuda.mem_get_info()[0] < needed * 1.3:
        pytest.skip(f"needs {needed * 1.3 / 2**30:.1f} GiB free GPU memory")
    dtype = fp8_dtypes()[-1]
    check(*build((700, 1, 1500), (1, 1, 60), 16, 8, 4, 128, dtype, torch.float16, extra_blocks=extra))


@pytest.mark.parametrize("head_dim,queries_per_kv,block_size", [(80, 5, 16), (96, 2, 64), (256, 1, 128), (64, 7, 32)])
def test_odd_head_dims_gqa_ratios_and_block_sizes(head_dim, queries_per_kv, block_size) -> None:
    """Head dims padded to a power of two, GQA ratios that are not powers of two, the largest block sizes."""
    seq_lens, query_lens = (3, 129, 1000, 77), (3, 1, 17, 77)
    check(*build(seq_lens, query_lens, block_size, 3, queries_per_kv, head_dim, KVDtype.FP16, torch.float16))


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP16, KVDtype.FP8_E5M2])
def test_long_context_decode(kv_dtype) -> None:
    """32k- and 20k-token contexts decoded in one batch with a chunk after 12k cached tokens."""
    seq_lens, query_lens = (32768, 20000, 12300), (1, 1, 300)
    check(*build(seq_lens, query_lens, 16, 8, 4, 128, kv_dtype, torch.float16))


@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim", [(1, 3, 80), (37, 1, 64), (4099, 8, 128)])
@pytest.mark.parametrize("kv_dtype", [KVDtype.BF16, KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_kv_write_with_scales_odd_shapes(num_tokens, num_kv_heads, head_dim, kv_dtype) -> None:
    """fp16 inputs written by Triton and by torch are the same bytes: one token, a single KV head, odd head dims."""
    if kv_dtype.is_fp8 and kv_dtype not in fp8_dtypes():
        pytest.skip("fp8_e4m3 needs compute capability 8.9+")
    gen = torch.Generator(device="cpu").manual_seed(num_tokens)
    blocks = -(-num_tokens // 16) + 3
    key, value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).mul(5).half().to(CUDA)
                  for _ in range(2))
    slots = torch.randperm(blocks * 16, generator=gen)[:num_tokens].to(CUDA)
    k_scale, v_scale = (torch.rand(num_kv_heads, generator=gen) * 0.05 + 0.01 for _ in range(2))
    caches = []
    for impl in (select_attention_impl("torch", CUDA), ATTENTION_IMPLS.get("triton")()):
        cache = KVCache(KVCacheSpec(1, num_kv_heads, head_dim, 16, kv_dtype), blocks, CUDA)
        if kv_dtype.is_fp8:
            cache.set_scales(0, k_scale, v_scale)
        write_kv(impl, key, value, cache.layers[0], slots)
        caches.append(cache.layers[0])
    for name in ("k", "v"):
        a, b = getattr(caches[0], name), getattr(caches[1], name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_engine_greedy_tokens_match_torch_backend_on_gpu(tmp_path) -> None:
    from pagedserve.engine import LLM, SamplingParams

    model = str(make_tiny(tmp_path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (200, 3, 50)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(model, attention_backend=backend, device="cuda", dtype="float32", kv_cache_memory=1 << 26,
                  max_num_batched_tokens=64)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
