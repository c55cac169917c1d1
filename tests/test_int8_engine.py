"""The engine over an int8 KV cache: its block count (>= 1.9x a 16-bit cache's), preemption, chunked prefill, parallel
samples and the prefix cache keeping int8 outputs, logits nearer fp32 than FP8's, the CLI flag and metrics; bad dtype
names are refused naming the field."""

from __future__ import annotations

import pytest

from pagedserve.engine import EngineConfig, LLM, SamplingParams
from pagedserve.engine.errors import ConfigError
from pagedserve.kernels.kv_cache import KVCacheSpec, KVDtype


@pytest.mark.parametrize("head_dim", [64, 128, 72])
def test_blocks_per_byte_are_at_least_1_9x_of_16_bit(head_dim: int) -> None:
    specs = {kv: KVCacheSpec(30, 3, head_dim, 16, kv) for kv in (KVDtype.BF16, KVDtype.INT8)}
    budget = 1 << 30
    ratio = specs[KVDtype.INT8].num_blocks_for(budget) / specs[KVDtype.BF16].num_blocks_for(budget)
    assert ratio == pytest.approx(2 * head_dim / (head_dim + 2), rel=1e-3) and ratio >= 1.9


def test_engine_counts_int8_blocks_and_reports_the_dtype(tiny_llama: str) -> None:
    memory = 1 << 22
    blocks = {}
    for kv in ("fp16", "int8", "fp8"):
        llm = LLM(tiny_llama, kv_cache_dtype=kv, kv_cache_memory=memory, dtype="float32")
        stats = llm.engine.stats()
        blocks[stats.kv_cache_dtype] = stats.num_kv_blocks
    assert set(blocks) == {"fp16", "int8", "fp8_e4m3"}  # vLLM's `fp8` is e4m3
    assert blocks["int8"] / blocks["fp16"] >= 1.9 and blocks["fp8_e4m3"] == 2 * blocks["fp16"]


@pytest.mark.parametrize("name", ["int4", "INT8", "fp8,int8", "int8/fp16", ""])
def test_bad_or_mixed_dtype_names_are_refused_naming_the_field(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(kv_cache_dtype=name)
    assert info.value.field == "kv_cache_dtype" and "int8" in str(info.value) and "fp8" in str(info.value)


# --- the engine end to end ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from conftest import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama-int8"), hidden_size=192,
                                   num_attention_heads=3, num_key_value_heads=1, initializer_range=0.1))


PROMPTS = [list(range(100, 137)), [400, 401, 402], [5, 17, 300, 42, 9, 1000, 77, 8, 123, 9, 9, 31, 64, 64, 2000, 3,
                                                    4, 5, 6, 7, 8]]


def _generate(llm: LLM, prompts, max_tokens: int = 8, n: int = 1) -> list[list[list[int]]]:
    # top_k 1: every sample takes the argmax (n > 1 needs a temperature)
    params = SamplingParams(temperature=1.0 if n > 1 else 0.0, top_k=1 if n > 1 else 0, max_tokens=max_tokens,
                            ignore_eos=True, n=n)
    return [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params)]


def test_preemption_and_chunked_prefill_keep_int8_outputs(tiny_llama: str) -> None:
    """Recomputed (preempted) and chunked prefills write the same rows and scales: the tokens of an unconstrained
    run. 6 blocks of 16 tokens are far less than the three sequences need at once (5 + 3 + 4 after 40 new tokens):
    they outgrow the block each keeps to spare and one is preempted. (At 48 new tokens the third prompt meets a
    near-tie, top two log-probabilities 2e-4 apart, that the prefill's and the decode's fp32 arithmetic order
    decide differently.)"""
    roomy = _generate(LLM(tiny_llama, kv_cache_dtype="int8", kv_cache_memory=1 << 22, dtype="float32"), PROMPTS, 40)
    spec = KVCacheSpec(2, 1, 64, 16, KVDtype.INT8)
    tight = LLM(tiny_llama, kv_cache_dtype="int8", kv_cache_memory=6 * spec.bytes_per_block, dtype="float32",
                max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _generate(tight, PROMPTS, 40) == roomy
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_free_kv_blocks == stats.num_kv_blocks


def test_parallel_samples_copy_row_scales_with_their_block(tiny_llama: str) -> None:
    """n samples share the prompt's partly filled last block until each writes into it (copy-on-write): the copy
    must carry the rows' scales, or every sample but one would read zeros."""
    llm = LLM(tiny_llama, kv_cache_dtype="int8", kv_cache_memory=1 << 22, dtype="float32", enable_prefix_caching=False)
    single = _generate(llm, PROMPTS[2:], 10)[0][0]
    assert len(PROMPTS[2]) % 16 != 0
    assert _generate(llm, PROMPTS[2:], 10, n=3)[0] == [single] * 3


def test_prefix_cache_serves_int8_blocks_unchanged(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, kv_cache_dtype="int8", kv_cache_memory=1 << 22, dtype="float32")
    shared = list(range(1000, 1040))
    first = _generate(llm, [shared + [7, 8]])
    hits = llm.engine.stats().prefix_cache_hits
    second = _generate(llm, [shared + [9, 10, 11]])
    assert llm.engine.stats().prefix_cache_hits >= hits + 32  # two whole blocks reused
    fresh = LLM(tiny_llama, kv_cache_dtype="int8", kv_cache_memory=1 << 22, dtype="float32")
    assert second == _generate(fresh, [shared + [9, 10, 11]]) and first == _generate(fresh, [shared + [7, 8]])


def test_int8_logits_stay_closer_to_fp32_than_fp8_and_bf16_caches(tiny_llama: str) -> None:
    """Each prompt prefilled in 8-token chunks, so later chunks read earlier ones back from the cache: the next-token
    log-probabilities of int8, FP8 and bf16 caches against an fp32 one. int8 per-token rows (7 bits of magnitude per
    row) sit between bf16 (8 bits per value) and e4m3 (4 bits). A random model's logits are nearly flat, so its
    greedy continuations are no measure; the real-model bounds are benchmarks/fp8_kv_accuracy.py's."""
    top = {}
    for kv in ("fp32", "bf16", "int8", "fp8"):
        llm = LLM(tiny_llama, kv_cache_dtype=kv, kv_cache_memory=1 << 22, dtype="float32", max_num_batched_tokens=8)
        out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))
        top[kv] = [dict(o.outputs[0].logprobs[0].top) for o in out]

    def error(kv: str) -> float:
        return max(abs(ref[t] - got[t]) for ref, got in zip(top["fp32"], top[kv]) for t in ref.keys() & got.keys())

    # measured: bf16 0.010, int8 0.037, fp8 0.28
    assert error("int8") < 0.25 * error("fp8") and error("int8") < 0.05


def test_cli_flag_reaches_the_engine_and_the_metrics_say_it(tiny_llama: str) -> None:
    """`pagedserve serve --kv-cache-dtype int8` (and vLLM's `fp8`): ModelInfo's kv_cache_dtype and
    vllm:cache_config_info's cache_dtype label report the cache as built."""
    from prometheus_client import generate_latest

    from pagedserve.engine import LLMEngine
    from pagedserve.service.cli import build_parser, engine_config
    from pagedserve.service.core.metrics import ServiceMetrics

    for flag, built in (("int8", "int8"), ("fp8", "fp8_e4m3")):
        args = build_parser().parse_args(["serve", "--model", tiny_llama, "--kv-cache-dtype", flag,
                                          "--kv-cache-memory", "4MiB", "--dtype", "float32"])
        engine = LLMEngine(engine_config(args))
        assert engine.describe().kv_cache_dtype == built
        text = generate_latest(ServiceMetrics("m", engine.stats).registry).decode()
        assert f'cache_dtype="{built}"' in text and "vllm:cache_config_info{" in text
