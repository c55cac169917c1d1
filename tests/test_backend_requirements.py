"""Each kernel implementation declares what it needs of the engine config on its class (kernels/requirements.py);
the engine build (`check_backends`) enforces whatever the chosen class declares, naming the field; EngineConfig
itself knows no backend."""

from __future__ import annotations

import pytest

from pagedserve.engine.build import check_backends
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError
from pagedserve.kernels.backends import ATTENTION_IMPLS, LAYER_OPS, attention_requirements, layer_ops_requirements
from pagedserve.kernels.native_attention import NativeCpuAttention
from pagedserve.kernels.requirements import Requirements


def validated(**fields) -> EngineConfig:
    """The config as the engine's build checks it, before anything loads (engine/build.py: check_backends)."""
    config = EngineConfig(**fields)
    check_backends(config)
    return config


def test_every_registered_implementation_declares_requirements():
    for registry, lookup in ((ATTENTION_IMPLS, attention_requirements), (LAYER_OPS, layer_ops_requirements)):
        for name in registry.names():
            assert isinstance(lookup(name), Requirements), name
    assert attention_requirements("auto") == Requirements() == layer_ops_requirements("auto")
    assert attention_requirements("native").cpu_only and layer_ops_requirements("native").cpu_only
    assert not attention_requirements("torch").cpu_only and not layer_ops_requirements("torch").cpu_only


@pytest.mark.parametrize("field", ["attention_backend", "layer_ops"])
def test_a_cpu_only_implementation_is_refused_on_cuda_naming_its_field(field):
    with pytest.raises(ConfigError, match="native runs on CPU tensors only") as err:
        validated(device="cuda", **{field: "native"})
    assert err.value.field == field
    validated(device="cpu", **{field: "native"})


@pytest.mark.skipif("triton" not in ATTENTION_IMPLS, reason="triton is not installed")
def test_triton_needs_blocks_of_16():
    with pytest.raises(ConfigError, match=r"block_size >= 16") as err:
        validated(attention_backend="triton", block_size=8)
    assert err.value.field == "block_size"
    validated(attention_backend="triton", block_size=16)


def test_the_config_reads_the_rule_from_the_class(monkeypatch):
    monkeypatch.setattr(NativeCpuAttention, "requirements",
                        Requirements(cpu_only=True, min_block_size=32, block_size_reason="needs 32-token blocks"))
    with pytest.raises(ConfigError, match="needs 32-token blocks") as err:
        validated(attention_backend="native", block_size=16)
    assert err.value.field == "block_size"
    validated(attention_backend="native", block_size=32)
    validated(attention_backend="torch", block_size=16)  # another class, its own (empty) rules


def test_a_minimum_without_a_reason_is_refused():
    with pytest.raises(ValueError, match="block_size_reason"):
        Requirements(min_block_size=16)
