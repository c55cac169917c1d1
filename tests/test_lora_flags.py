"""LoRA's serve flags, checked without starting the LoRA server of tests/test_lora_surfaces.py: the flags build the
engine's LoraConfig, a bad one is refused naming its field before anything loads, and the default server (LoRA off,
the shared one) answers runtime load, unload and a named adapter as vLLM does."""

from __future__ import annotations

import grpc
import pytest
from lora_surface_fixtures import post

from pagedserve.client import Client, ClientError
from pagedserve.engine.errors import ConfigError
from pagedserve.service.cli import build_parser, engine_config


def test_lora_flags_build_the_lora_config():
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x/a",
                                      '{"name": "b", "path": "/x/b"}', "--max-loras", "3", "--max-lora-rank", "32",
                                      "--enable-runtime-lora-updates", "--allowed-lora-dirs", "/x"])
    lora = engine_config(args).lora
    assert [(m.name, m.path) for m in lora.modules] == [("a", "/x/a"), ("b", "/x/b")]
    assert (lora.max_loras, lora.max_lora_rank, lora.runtime_updates, lora.allowed_dirs) == (3, 32, True, ("/x",))
    assert engine_config(build_parser().parse_args(["serve"])).lora is None


def test_base_model_name_may_be_any_served_alias():
    """vLLM's --served-model-name takes aliases of the one base; a JSON module may name any of them."""
    args = build_parser().parse_args(["serve", "--served-model-name", "m", "m-alias", "--enable-lora",
                                      "--lora-modules", '{"name": "a", "path": "/x", "base_model_name": "m-alias"}'])
    assert [(m.name, m.path) for m in engine_config(args).lora.modules] == [("a", "/x")]


@pytest.mark.parametrize("flags, field", [
    (["--lora-modules", "a=/x"], "enable_lora"),
    (["--enable-lora", "--lora-modules", "a"], "lora_modules"),
    (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/x", "rank": 4}'], "lora_modules"),
    (["--enable-lora", "--served-model-name", "m", "--lora-modules", '{"name": "a", "path": "/x", '
      '"base_model_name": "other"}'], "lora_modules.base_model_name"),
    (["--enable-lora", "--enable-runtime-lora-updates", "--allowed-lora-dirs", "relative"], "allowed_lora_dirs"),
    (["--enable-lora", "--enable-runtime-lora-updates"], "allowed_lora_dirs"),
    (["--enable-lora", "--lora-modules", "a b=/x"], "lora_modules.name"),
])
def test_bad_lora_flags_name_the_field(flags, field):
    with pytest.raises(ConfigError) as error:
        engine_config(build_parser().parse_args(["serve", *flags]))
    assert error.value.field == field


def test_runtime_updates_off_refuse_load_and_unload(shared_server):
    """The default server (LoRA off): load/unload are 404 as in vLLM (no such routes) / FAILED_PRECONDITION; listing
    works and names no adapter; a request naming an adapter is 404 naming `model`."""
    status, reply = post(shared_server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp"})
    assert status == 404 and "--enable-runtime-lora-updates" in reply["error"]["message"]
    assert post(shared_server, "/v1/unload_lora_adapter", {"lora_name": "a"})[0] == 404
    with Client(shared_server.target, timeout=60) as c:
        listed = c.list_adapters()
        assert listed.adapters == () and not listed.lora_enabled and not listed.runtime_updates
        with pytest.raises(ClientError) as error:
            c.load_adapter("a", "/tmp")
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(ClientError) as error:
            c.complete("hi", adapter="a", max_new_tokens=2)
        assert error.value.code == grpc.StatusCode.NOT_FOUND and error.value.field == "adapter"
