"""The offline LLM(...) takes a vLLM script's constructor arguments where they mean what this engine does
(engine/llm_args.py): parallel sizes of 1, trust_remote_code, swap_space and disable_log_stats (nothing to do),
gpu_memory_utilization (CUDA only), vLLM's spellings (kv_cache_memory_bytes) and settings (speculative_config,
compilation_config, structured_outputs_config as dicts; enable_lora with its limits); larger parallel sizes and
what this engine never does are refused naming the argument, and so is a name neither knows."""

from __future__ import annotations

import pytest
import transformers
from conftest import hf_greedy, make_tiny_model

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.errors import ConfigError, InvalidRequestError
from pagedserve.engine.llm_args import engine_fields
from pagedserve.engine.lora.config import LoraConfig

VLLM_ARGUMENTS = dict(tensor_parallel_size=1, pipeline_parallel_size=1, trust_remote_code=True, swap_space=4,
                      gpu_memory_utilization=0.9, enforce_eager=True, seed=0, disable_log_stats=True,
                      enable_chunked_prefill=True, kv_cache_memory_bytes=4 << 20, compilation_config=3,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
                      structured_outputs_config={"backend": "auto", "disable_fallback": True},
                      enable_lora=True, max_loras=2, max_lora_rank=8)


def test_a_vllm_scripts_arguments_build_the_same_engine(tmp_path):
    path = make_tiny_model(tmp_path)
    llm = LLM(str(path), dtype="float32", **VLLM_ARGUMENTS)
    config = llm.engine.config
    assert config.kv_cache_memory == 4 << 20 and config.speculative.num_speculative_tokens == 2
    assert (config.lora.max_loras, config.lora.max_lora_rank) == (2, 8)
    prompt = [1, 450, 4996, 17354, 1701, 450, 4996, 17354]  # repeats, so the n-gram drafter proposes
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    reference = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    assert list(out[0].outputs[0].token_ids) == hf_greedy(reference, prompt, 6)


def test_vllms_settings_map_onto_the_engine_fields():
    fields = engine_fields({"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4], "cudagraph_mode": "NONE"},
                            "structured_outputs_config": {"reasoning_parser": "qwen3", "enable_in_reasoning": True}})
    assert fields == {"cuda_graph_sizes": (1, 2, 4), "enforce_eager": True, "reasoning_parser": "qwen3",
                      "constraints_in_reasoning": True}
    assert engine_fields({"max_loras": None, "enable_lora": False}) == {}


@pytest.mark.parametrize(("arguments", "field", "message"), [
    ({"enable_chunked_prefill": False}, "enable_chunked_prefill", "always chunked"),
    ({"max_loras": 2}, "max_loras", "pass enable_lora=True"),
    ({"kv_cache_memory_bytes": 1 << 20, "kv_cache_memory": 2 << 20}, "kv_cache_memory_bytes", "disagrees"),
    ({"speculative_config": "ngram"}, "speculative_config", "must be a dict"),
    ({"speculative_config": {"method": "ngram"}}, "speculative_config.num_speculative_tokens", "is required"),
    ({"compilation_config": {"pass_config": {}}}, "compilation_config.pass_config", "unsupported key"),
    ({"structured_outputs_config": {"backend": "xgrammar"}}, "structured_outputs_config.backend", "not available"),
    ({"enable_lora": True, "lora": LoraConfig()}, "enable_lora", "sets lora"),
    ({"no_such_argument": 1}, "no_such_argument", "accepted: .*kv_cache_memory_bytes"),
])
def test_what_this_engine_does_not_do_is_refused_naming_the_argument(arguments, field, message):
    with pytest.raises(ConfigError, match=message) as info:
        engine_fields(arguments)
    assert info.value.field == field


@pytest.mark.parametrize("name", ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"])
def test_more_than_one_device_is_refused_naming_the_argument(name):
    with pytest.raises(ConfigError, match=rf"{name}: 2: one device per engine"):
        LLM(None, **{name: 2})


def test_an_unknown_argument_is_refused_before_anything_loads():
    with pytest.raises(ConfigError, match="no_such_argument: is not an argument of LLM"):
        LLM(None, no_such_argument=1)


def test_max_model_len_auto_is_what_the_kv_cache_holds(tmp_path):
    """vLLM's -1 ("auto"): the model's limit (512 here) or, when less, the tokens the KV cache holds; a prompt past
    it is refused naming the limit, as with an explicit max_model_len."""
    path = make_tiny_model(tmp_path)
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, 16 tokens, fp32
    llm = LLM(str(path), dtype="float32", kv_cache_memory=6 * block_bytes, max_model_len=-1)
    assert llm.engine.max_model_len == 6 * 16
    roomy = LLM(str(path), dtype="float32", kv_cache_memory=64 * block_bytes, max_model_len=-1)
    assert roomy.engine.max_model_len == 512  # the model's own limit
    with pytest.raises(InvalidRequestError, match="96"):
        llm.generate([[5] * 100], SamplingParams(max_tokens=1))
