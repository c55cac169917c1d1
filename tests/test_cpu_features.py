"""dtype=auto on CPU: bfloat16 where the kernel tier multiplies bf16 natively, else fp32 compute over the
checkpoint's own (16-bit) weights."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.host.cpu_features import cpu_flags, effective_bf16_flags, native_bf16_flags, tier_bf16_flags
from pagedserve.engine.loading.dtype_plan import DtypePlan, resolve_dtype
from pagedserve.kernels.cpu import isa

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile\n\nprocessor\t: 1\n"
ZEN3 = "processor\t: 0\nflags\t\t: fpu sse avx avx2 fma f16c\n"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("text,expected", [
    (SAPPHIRE_RAPIDS, ("amx_bf16", "avx512_bf16")),
    ("flags : fpu avx512f avx512_bf16\n", ("avx512_bf16",)),
    (ZEN3, ()),
    ("Features\t: fp asimd bf16\n", ()),  # Arm: not one of the x86 features the choice is made on
    ("", ()),
])
def test_native_bf16_is_read_from_the_flags(tmp_path, text, expected):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    assert native_bf16_flags(path) == expected


def test_unreadable_cpuinfo_means_no_native_bf16(tmp_path):
    assert native_bf16_flags(tmp_path / "missing") == ()
    assert "asimd" in cpu_flags("Features\t: fp asimd\n")


@pytest.mark.parametrize("checkpoint", ["float32", "float16", "bfloat16"])
def test_auto_is_bf16_on_a_native_bf16_cpu_whatever_the_checkpoint(checkpoint):
    assert resolve_dtype({"torch_dtype": checkpoint}, None, CPU, ("amx_bf16",)) == DtypePlan(torch.bfloat16,
                                                                                             torch.bfloat16)


@pytest.mark.parametrize("checkpoint,weights", [
    ("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16), (None, torch.float32),
])
def test_auto_computes_in_fp32_over_the_checkpoints_16_bit_weights_without_bf16_arithmetic(checkpoint, weights):
    assert resolve_dtype({"torch_dtype": checkpoint}, None, CPU, ()) == DtypePlan(torch.float32, weights)


def test_an_explicit_dtype_and_gpus_are_not_affected():
    assert resolve_dtype({"torch_dtype": "bfloat16"}, torch.float32, CPU, ()) == DtypePlan(torch.float32,
                                                                                          torch.float32)
    assert resolve_dtype({"torch_dtype": "float16"}, None, CUDA, ("amx_bf16",)) == DtypePlan(torch.float16,
                                                                                           torch.float16)


def test_a_forced_tier_answers_for_the_host_it_stands_in_for(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(SAPPHIRE_RAPIDS)
    assert tier_bf16_flags(None, path) == ("amx_bf16", "avx512_bf16")
    assert tier_bf16_flags(isa.tier("avx2"), path) == ()
    assert tier_bf16_flags(isa.tier("avx512_vnni"), path) == ()
    assert tier_bf16_flags(isa.tier("avx512_bf16"), path) == ("avx512_bf16",)


def test_the_plan_refuses_other_mixes():
    with pytest.raises(ValueError, match="only 16-bit weights"):
        DtypePlan(torch.bfloat16, torch.float32)


def test_the_engine_applies_the_rule_on_this_host(tmp_path, caplog):
    from conftest import make_tiny_model
    from pagedserve.engine import LLM, SamplingParams

    path = make_tiny_model(tmp_path)  # an fp32 checkpoint
    native = effective_bf16_flags()
    with caplog.at_level("INFO", logger="pagedserve.engine.loading"):
        auto = LLM(str(path), kv_cache_memory=1 << 22)
    assert auto.engine.loaded.dtype == (torch.bfloat16 if native else torch.float32)
    assert ("dtype=auto: computing in bfloat16" in caplog.text) == bool(native)
    same = LLM(str(path), kv_cache_memory=1 << 22, dtype="bfloat16" if native else "float32")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 300, 42], list(range(100, 120))]
    assert [o.outputs[0].token_ids for o in auto.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in same.generate(prompts, params)]
