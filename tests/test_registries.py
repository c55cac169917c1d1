"""The plug-in seams: names come from the registries alone, models register by being in their package, and the
model runner plans attention once per step."""

from __future__ import annotations

import pytest
from conftest import make_tiny_model

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.build import check_backends
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError, ModelLoadError
from pagedserve.engine.models.registry import discover_architectures, model_archs, model_class_for
from pagedserve.kernels.attention import AttentionImpl
from pagedserve.kernels.backends import ATTENTION_IMPLS, LAYER_OPS, attention_backend_names, layer_ops_names
from pagedserve.kernels.kv_cache import KVDtype
from pagedserve.quant.registry import QUANT_METHODS

NAMED_FIELDS = {
    "attention_backend": attention_backend_names,
    "layer_ops": layer_ops_names,
    "quantization": lambda: tuple(QUANT_METHODS.names()),
    "kv_cache_dtype": lambda: ("auto", "fp8", *(kv.value for kv in KVDtype)),  # fp8: vLLM's name for fp8_e4m3
}


@pytest.mark.parametrize("field", sorted(NAMED_FIELDS))
def test_config_accepts_exactly_the_registered_names(field):
    supported = NAMED_FIELDS[field]()
    for name in supported:
        check_backends(EngineConfig(**{field: name}))
    with pytest.raises(ConfigError) as info:
        check_backends(EngineConfig(**{field: "no-such-name"}))
    assert info.value.field == field
    assert str(info.value).endswith("supported: " + ", ".join(supported))


def test_backend_names_are_the_registries():
    assert attention_backend_names() == ("auto", *ATTENTION_IMPLS.names())
    assert {"torch", "native"} <= set(ATTENTION_IMPLS.names())
    assert layer_ops_names() == ("auto", *LAYER_OPS.names())
    assert {"native", "torch"} <= set(LAYER_OPS.names()) <= {"native", "torch", "triton"}  # triton where installed


def test_layer_ops_follow_the_torch_reference_path_only_when_left_on_auto():
    assert EngineConfig().layer_ops_choice == "auto"
    assert EngineConfig(attention_backend="torch").layer_ops_choice == "torch"
    assert EngineConfig(attention_backend="torch", layer_ops="native").layer_ops_choice == "native"
    assert EngineConfig(attention_backend="native", layer_ops="torch").layer_ops_choice == "torch"
    with pytest.raises(ConfigError, match="layer_ops: native runs on CPU"):
        check_backends(EngineConfig(layer_ops="native", device="cuda"))


def test_a_model_module_registers_by_being_in_the_package(tmp_path, monkeypatch):
    package = tmp_path / "fake_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "alpha.py").write_text("class Alpha:\n    pass\n\nARCHITECTURES = {'AlphaForCausalLM': Alpha}\n")
    (package / "helpers.py").write_text("VALUE = 1\n")  # no ARCHITECTURES: not a model, not an error
    (package / "beta.py").write_text("ARCHITECTURES = {'BetaForCausalLM': object, 'Beta2ForCausalLM': object}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    archs = discover_architectures("fake_models")
    assert archs.names() == ["AlphaForCausalLM", "Beta2ForCausalLM", "BetaForCausalLM"]
    assert archs.get("AlphaForCausalLM").__name__ == "Alpha"
    (package / "gamma.py").write_text("ARCHITECTURES = {'AlphaForCausalLM': object}\n")
    with pytest.raises(ValueError, match="'AlphaForCausalLM' registered twice"):
        discover_architectures("fake_models")


def test_unknown_architecture_says_where_a_model_registers():
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= set(model_archs().names())
    with pytest.raises(ModelLoadError, match=r"supported: .*LlamaForCausalLM.*ARCHITECTURES in a module of engine/models/"):
        model_class_for({"architectures": ["GPT2LMHeadModel"]})


class CountingAttention(AttentionImpl):
    """Delegates to a real implementation, recording which plan each layer's attention call received."""

    def __init__(self, inner: AttentionImpl):
        self.inner = inner
        self.plans: list[object] = []
        self.attention_plans: list[object] = []

    def plan(self, meta, cache, window=None):
        plan = self.inner.plan(meta, cache, window)
        self.plans.append(plan)
        return plan

    def write_kv(self, key, value, cache, slot_mapping):
        self.inner.write_kv(key, value, cache, slot_mapping)

    def attention(self, query, cache, meta, plan, scale):
        self.attention_plans.append(plan)
        return self.inner.attention(query, cache, meta, plan, scale)


def spy_on_steps(runner, monkeypatch) -> tuple[CountingAttention, list]:
    """The runner's attention wrapped in a CountingAttention, and the list every executed step is appended to."""
    spy = CountingAttention(runner.attn_impl)
    monkeypatch.setattr(runner, "attn_impl", spy)
    steps = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda batch: steps.append(batch) or execute(batch))
    return spy, steps


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_the_runner_plans_once_per_step_and_every_layer_uses_that_plan(tmp_path, monkeypatch, backend):
    # The per-op path: a native decode step (engine/runner/native_step.py) runs every layer in one C call, with no plans.
    llm = LLM(str(make_tiny_model(tmp_path)), dtype="float32", attention_backend=backend, native_step_max_batch=0)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    expected = llm.generate(["a b c", "d e"], params)
    runner = llm.engine.runner
    spy, steps = spy_on_steps(runner, monkeypatch)
    got = llm.generate(["a b c", "d e"], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    layers = runner.model.args.num_layers
    assert len(steps) >= 4 and len(spy.plans) == len(steps)
    assert len(spy.attention_plans) == len(steps) * layers
    for step, plan in enumerate(spy.plans):
        assert all(p is plan for p in spy.attention_plans[step * layers : (step + 1) * layers])


def test_the_runner_plans_once_per_window_and_each_layer_gets_its_windows_plan(tmp_path, monkeypatch):
    """Gemma 3: sliding and global layers interleave; each step plans once for each window, not once per layer."""
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    path = make_tiny_model(tmp_path, "Gemma3ForCausalLM", num_hidden_layers=3, head_dim=16, tie_word_embeddings=True,
                           sliding_window=4, layer_types=types)
    llm = LLM(str(path), dtype="float32", attention_backend="torch")
    runner = llm.engine.runner
    spy, steps = spy_on_steps(runner, monkeypatch)
    llm.generate(["a b c d e f g", "d e"], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(spy.plans) == 2 * len(steps)
    assert [p.window for p in spy.attention_plans[:3]] == [4, None, 4]
    for step in range(len(steps)):
        sliding, full = spy.plans[2 * step : 2 * step + 2]
        got = spy.attention_plans[3 * step : 3 * step + 3]
        assert all(plan is expected for plan, expected in zip(got, (sliding, full, sliding), strict=True))
