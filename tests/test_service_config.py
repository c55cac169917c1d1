"""`pagedserve serve` flags -> EngineConfig / ServerConfig, without starting anything."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.engine.config import EngineConfig
from pagedserve.engine.errors import ConfigError
from pagedserve.service.cli import build_parser, engine_config, parse_bytes, server_config
from pagedserve.service.config import CorsConfig


def parse(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_every_engine_config_field_has_a_flag():
    # Sub-configs with their own flag groups: LoRA (tests/test_lora_flags.py) and --speculative-config
    # (tests/test_spec_drafter.py).
    grouped = {"lora", "speculative"}
    assert {f.name for f in dataclasses.fields(EngineConfig)} - grouped <= set(vars(parse()))
    assert "speculative_config" in vars(parse())


def test_engine_flags_reach_the_engine_config():
    config = engine_config(parse("--kv-cache-memory", "512MiB", "--block-size", "32", "--max-num-seqs", "8",
                                 "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8_e4m3", "--max-model-len",
                                 "1024"))
    assert config.kv_cache_memory == 512 << 20 and config.block_size == 32 and config.max_num_seqs == 8
    assert config.enable_prefix_caching is False and config.kv_cache_dtype == "fp8_e4m3"
    assert config.max_model_len == 1024


def test_unset_engine_flags_keep_engine_defaults():
    assert engine_config(parse()) == EngineConfig()


@pytest.mark.parametrize("text, expected", [("1024", 1024), ("2GiB", 2 << 30), ("1.5MiB", 3 << 19), ("10MB", 10**7)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_invalid_engine_value_names_the_field():
    with pytest.raises(ConfigError, match="block_size"):
        engine_config(parse("--block-size", "7"))


def test_tls_needs_both_cert_and_key(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match="tls"):
        server_config(parse("--tls-cert", str(cert)))
    with pytest.raises(ConfigError, match="not found"):
        server_config(parse("--tls-cert", str(cert), "--tls-key", str(tmp_path / "missing.key")))


def test_vllms_client_certificate_flags(tmp_path):
    """--ssl-ca-certs with --ssl-cert-reqs 2 is --tls-client-ca; 0 (vLLM's default) asks clients for nothing;
    1 cannot be served on gRPC and is refused, as is 2 without a CA or with two different ones."""
    for name in ("c.pem", "k.pem", "ca.pem", "other.pem"):
        (tmp_path / name).write_text("x")
    pair = ("--ssl-certfile", str(tmp_path / "c.pem"), "--ssl-keyfile", str(tmp_path / "k.pem"))
    ours = server_config(parse(*pair, "--tls-client-ca", str(tmp_path / "ca.pem"))).tls
    vllms = server_config(parse(*pair, "--ssl-ca-certs", str(tmp_path / "ca.pem"), "--ssl-cert-reqs", "2")).tls
    assert ours == vllms and vllms.mutual
    assert not server_config(parse(*pair, "--ssl-ca-certs", str(tmp_path / "ca.pem"))).tls.mutual
    assert not server_config(parse(*pair, "--ssl-cert-reqs", "0")).tls.mutual
    refused = {
        ("--ssl-cert-reqs", "1"): "ssl_cert_reqs.*cannot be served on gRPC",
        ("--ssl-cert-reqs", "2"): "ssl_cert_reqs.*needs the CA",
        ("--ssl-cert-reqs", "0", "--tls-client-ca", str(tmp_path / "ca.pem")): "ssl_cert_reqs.*requires one",
        ("--ssl-cert-reqs", "2", "--tls-client-ca", str(tmp_path / "ca.pem"), "--ssl-ca-certs",
         str(tmp_path / "other.pem")): "ssl_ca_certs.*disagrees",
        ("--ssl-ca-certs", str(tmp_path / "absent.pem")): "ssl_ca_certs.*not found",
    }
    for flags, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            server_config(parse(*pair, *flags))
    with pytest.raises(SystemExit):
        parse("--ssl-cert-reqs", "3")


def test_vllms_cors_flags_take_json_lists_or_plain_values():
    assert server_config(parse()).cors == CorsConfig()  # vLLM's defaults: any origin, method, header; no credentials
    config = server_config(parse("--allowed-origins", '["https://a.example", "https://b.example"]',
                                 "--allowed-methods", "GET", "POST", "--allow-credentials")).cors
    assert config == CorsConfig(("https://a.example", "https://b.example"), ("GET", "POST"), ("*",), True)
    for bad in ('["unclosed"', '{"a": 1}', "[1, 2]"):
        with pytest.raises(SystemExit):
            parse("--allowed-origins", bad)
    with pytest.raises(ConfigError) as info:
        server_config(parse("--allowed-headers", "[]", "x", " "))
    assert info.value.field == "allowed_headers"


@pytest.mark.parametrize("root", ["llm", "/llm/", ""])
def test_a_root_path_is_one_absolute_prefix(root):
    with pytest.raises(ConfigError) as info:
        server_config(parse("--root-path", root))
    assert info.value.field == "root_path"


@pytest.mark.parametrize(("text", "tokens"), [("4096", 4096), ("32k", 32000), ("25.6k", 25600), ("1K", 1024),
                                             ("128Ki", 131072), ("1M", 10**6), ("1Mi", 2**20), ("auto", -1), ("-1", -1)])
def test_token_counts_read_as_vllms(text, tokens):
    assert engine_config(parse("--max-model-len", text)).max_model_len == tokens
    if tokens > 0:
        assert engine_config(parse("--max-num-batched-tokens", text)).max_num_batched_tokens == tokens


@pytest.mark.parametrize("text", ["1.5K", "1.5", "lots", "1ki", "-2"])
def test_a_token_count_that_is_none_stops_the_parse(text):
    with pytest.raises(SystemExit):
        parse("--max-model-len", text)


def test_mesh_options_become_grpc_channel_args():
    config = server_config(parse("--max-connection-age", "300", "--keepalive-time", "30",
                                 "--max-message-bytes", "8MiB"))
    options = dict(config.grpc_options())
    assert options["grpc.max_connection_age_ms"] == 300_000
    assert options["grpc.keepalive_time_ms"] == 30_000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    # the transport cap sits above the servicer's limit so over-limit requests get a message naming the limit
    assert options["grpc.max_receive_message_length"] > config.max_message_bytes == 8 << 20
    assert "grpc.max_connection_age_ms" not in dict(server_config(parse()).grpc_options())


def test_cpu_isa_flag_sets_the_tier_the_kernels_build_for(monkeypatch):
    from pagedserve.kernels.cpu import isa
    from pagedserve.service.cli import force_cpu_isa, main

    monkeypatch.delenv(isa.ENV_VAR, raising=False)
    assert parse("--cpu-isa", "portable").cpu_isa == "portable" and parse().cpu_isa is None
    force_cpu_isa("portable")
    assert isa.requested_tier().name == "portable"
    assert main(["serve", "--cpu-isa", "avx9"]) == 2  # refused before any model loads
