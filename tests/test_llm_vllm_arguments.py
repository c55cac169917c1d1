"""The offline LLM(...) takes a vLLM script's constructor arguments where they mean what this engine does: parallel
sizes of 1, trust_remote_code and swap_space (nothing to do), gpu_memory_utilization (CUDA only); larger parallel
sizes are refused naming the argument, and a name neither knows stays a TypeError."""

from __future__ import annotations

import pytest
import transformers
from conftest import hf_greedy, make_tiny_model

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.errors import ConfigError

VLLM_ARGUMENTS = dict(tensor_parallel_size=1, pipeline_parallel_size=1, trust_remote_code=True, swap_space=4,
                      gpu_memory_utilization=0.9, enforce_eager=True, seed=0)


def test_a_vllm_scripts_arguments_build_the_same_engine(tmp_path):
    path = make_tiny_model(tmp_path)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, **VLLM_ARGUMENTS)
    prompt = [1, 450, 4996, 17354, 1701]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    reference = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    assert list(out[0].outputs[0].token_ids) == hf_greedy(reference, prompt, 6)


@pytest.mark.parametrize("name", ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"])
def test_more_than_one_device_is_refused_naming_the_argument(name):
    with pytest.raises(ConfigError, match=rf"{name}: 2: one device per engine"):
        LLM(None, **{name: 2})


def test_an_unknown_argument_is_still_a_type_error():
    with pytest.raises(TypeError, match="no_such_argument"):
        LLM(None, no_such_argument=1)
