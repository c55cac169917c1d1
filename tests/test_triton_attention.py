"""The Triton PagedAttention kernel against the torch implementation (the CPU serving path) on identical caches.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton is
imported); with CUDA they compile and the same cases run on the GPU. Shapes stay small because the interpreter
executes every program instance in Python: the whole file takes well under a minute on 2 cores.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attention_cases import (  # noqa: E402
    BATCHES,
    DEVICE,
    SCALE,
    TOLERANCE,
    assert_matches_torch,
    float64_reference,
    make_case,
    poison_stale_slots,
)
from pagedserve.kernels.kv_cache import KVDtype  # noqa: E402
from pagedserve.kernels.backends import ATTENTION_IMPLS, select_attention_impl  # noqa: E402
from pagedserve.kernels.paged_attention import paged_attention  # noqa: E402
from pagedserve.kernels.triton_backend import TritonAttention  # noqa: E402

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
    assert_matches_torch(ATTENTION_IMPLS.get("triton")(), query, layer, meta)


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP16, KVDtype.FP8_E4M3, KVDtype.FP32])
def test_head_dim_128_and_fp32(kv_dtype: KVDtype) -> None:
    seq_lens, query_lens = BATCHES["mixed"]
    query, layer, meta = make_case(seq_lens, query_lens, 16, 4, kv_dtype, head_dim=128, seed=1)
    reference, result = run_both(query, layer, meta)
    assert (result.float() - reference.float()).abs().max().item() <= TOLERANCE[query.dtype]


@pytest.mark.parametrize("kv_dtype", [KVDtype.FP8_E4M3, KVDtype.FP8_E5M2])
def test_with_hadamard_rotated_keys(kv_dtype: KVDtype) -> None:
    """The entry points rotate and centre K on write and rotate Q on attention; both implementations see the same data."""
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
    poison_stale_slots(layer, meta)
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


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "int8"])
def test_engine_generates_through_triton_like_the_torch_path(tiny_llama: str, kv_cache_dtype: str) -> None:
    """Greedy generation, token for token, with chunked prefills (16-token budget) mixed into decode steps."""
    from pagedserve.engine import LLM, SamplingParams

    prompts = [list(range(100, 130)), [400, 401, 402], [5, 17, 300, 42, 9, 1000, 77, 8, 123]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            tiny_llama, attention_backend=backend, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 22, dtype="float32",
            max_num_batched_tokens=16, device=DEVICE.type,
        )
        impl = llm.engine.runner.attn_impl
        assert isinstance(getattr(impl, "inner", impl), TritonAttention) == (backend == "triton")
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 5 for t in tokens["torch"])


def test_engine_with_sliding_windows_through_triton_like_the_torch_path(tmp_path) -> None:
    """Gemma 3 (a 5-token window on two of three layers, the third global) generates the same greedy tokens through
    Triton as through the torch path, with 16-token chunks crossing the window edges."""
    from conftest import make_tiny_model
    from pagedserve.engine import LLM, SamplingParams

    path = make_tiny_model(
        tmp_path, "Gemma3ForCausalLM", num_hidden_layers=3, head_dim=16, tie_word_embeddings=True,
        sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        initializer_range=0.1,
    )
    prompts = [list(range(100, 140)), [400, 401, 402], list(range(700, 721))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(path), attention_backend=backend, max_num_batched_tokens=16, kv_cache_memory=1 << 22,
                  dtype="float32", device=DEVICE.type)
        assert llm.engine.runner.windows == (5, None)
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
