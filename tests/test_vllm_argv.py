"""`vllm serve` command lines as vLLM reads them (service/vllm_argv.py): underscores in option names, a JSON
flag's keys given one by one (`--speculative-config.method ngram`, `-O.cudagraph_mode=NONE`, `-O3`), and
`--config FILE` (YAML) whose flags the command line overrides. Parsed in this process into the same EngineConfig and
ServerConfig a start builds; a real server started from a config file is tests/test_cli_vllm_flags.py's."""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import pytest

from pagedserve.service.cli import build_parser, engine_config, main, server_config
from pagedserve.service.vllm_argv import dashed, vllm_argv

CONFIG = """\
model: SmolLM2-135M-Instruct
port: 6379
max-num-seqs: 7
max_model_len: 512            # underscores, as vLLM's parser takes them
enable-prefix-caching: false  # a flag with a --no- form
trust-remote-code: true       # a switch
enforce-eager: false          # a switch left out
cuda-graph-sizes: [1, 2, 4]   # a flag of several values
speculative-config: {method: ngram, num_speculative_tokens: 3, prompt_lookup_max: 4}
kv-cache-memory-bytes: 64MiB
tensor-parallel-size: 1
"""


def _parse(argv: list[str]):
    parser = build_parser()
    args = parser.parse_args(vllm_argv(parser, argv))
    return args, engine_config(args), server_config(args)


@pytest.mark.parametrize(("token", "expected"), [
    ("--max_model_len", "--max-model-len"), ("--gpu_memory_utilization=0.5", "--gpu-memory-utilization=0.5"),
    ("--served-model-name", "--served-model-name"), ("my_model", "my_model"), ("-tp", "-tp"), ("--", "--"),
    ("--chat-template=a_b.jinja", "--chat-template=a_b.jinja"),  # the value keeps its underscores
])
def test_option_names_take_underscores(token, expected):
    assert dashed(token) == expected


def test_an_underscored_command_line_parses_as_the_dashed_one():
    _, engine, server = _parse(["serve", "--max_model_len", "256", "--kv_cache_memory=32MiB",
                                "--no_enable_prefix_caching", "--max_num_seqs", "3", "--http_port", "0"])
    assert (engine.max_model_len, engine.kv_cache_memory, engine.enable_prefix_caching) == (256, 32 << 20, False)
    assert engine.max_num_seqs == 3 and server.http_port == 0


def test_dotted_keys_build_their_flags_json():
    _, engine, _ = _parse(["serve", "--speculative-config.method", "ngram",
                           "--speculative_config.num_speculative_tokens=3", "--max_model_len", "256",
                           "--speculative-config.prompt_lookup_max", "4", "-O.cudagraph_mode=NONE",
                           "-O.cudagraph_capture_sizes", "[1, 2, 8]"])
    spec = engine.speculative
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, engine.max_model_len) == (3, 4, 256)
    assert engine.enforce_eager is True and engine.cuda_graph_sizes == (1, 2, 8)


def test_dotted_keys_go_over_the_flags_own_json_and_o3_is_a_level():
    _, engine, _ = _parse(["serve", "--compilation-config", '{"cudagraph_capture_sizes": [4], "mode": 3}',
                           "-O.cudagraph_capture_sizes", "[1, 2]"])  # -O is --compilation-config: one object
    assert engine.cuda_graph_sizes == (1, 2) and engine.enforce_eager is False
    parser = build_parser()
    assert vllm_argv(parser, ["serve", "-O3", "--compilation-config.cudagraph_mode", "NONE"]) == \
        ["serve", "--compilation-config", '{"mode": 3, "cudagraph_mode": "NONE"}']
    assert vllm_argv(parser, ["serve", "-O", "2"]) == ["serve", "--compilation-config", '{"mode": 2}']
    assert vllm_argv(parser, ["serve", "--gpu-memory-utilization", "0.9", "-O", '{"mode": 3}']) == \
        ["serve", "--gpu-memory-utilization", "0.9", "-O", '{"mode": 3}']  # nothing dotted: as it was


def test_a_config_files_dotted_keys_and_the_command_lines_go_together(tmp_path: Path):
    """A file entry may be one key of a JSON flag; the command line's keys and objects go over the file's."""
    (tmp_path / "config.yaml").write_text("compilation-config.cudagraph_capture_sizes: [1, 2, 4]\n"
                                          "compilation_config.cudagraph_mode: NONE\n"
                                          "speculative-config: {method: ngram, num_speculative_tokens: 2}\n")
    _, engine, _ = _parse(["serve", "--config", str(tmp_path / "config.yaml"), "-O.cudagraph_mode=FULL_DECODE_ONLY",
                           "--speculative-config.num_speculative_tokens", "4"])
    assert engine.cuda_graph_sizes == (1, 2, 4) and engine.enforce_eager is False  # the line's mode over the file's
    assert engine.speculative.num_speculative_tokens == 4 and engine.speculative.method == "ngram"
    (tmp_path / "bad.yaml").write_text("max-model-len.x: 1\n")
    with pytest.raises(SystemExit):  # not a JSON flag: argparse names it
        _parse(["serve", "--config", str(tmp_path / "bad.yaml")])


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--speculative-config.method"], "expects a value"),
    (["serve", "-O", "3", "-O.cudagraph_mode=NONE", "-O.mode.x=1"], "mode already holds a value"),
    (["serve", "--compilation-config", "[1]", "-O.mode=3"], "must be an object"),
    (["serve", "-O.pass_config.x=1"], "compilation_config.pass_config"),  # unknown keys still refused by name
])
def test_dotted_mistakes_are_named(argv, message):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(argv)
    assert code == 2 and message in stderr.getvalue(), stderr.getvalue()


def test_a_config_file_sets_the_flags_it_names(tmp_path: Path):
    (tmp_path / "config.yaml").write_text(CONFIG)
    args, engine, server = _parse(["serve", "--config", str(tmp_path / "config.yaml")])
    assert engine.model == "SmolLM2-135M-Instruct" and server.port == 6379 and engine.max_num_seqs == 7
    assert engine.max_model_len == 512 and engine.enable_prefix_caching is False and args.trust_remote_code
    assert engine.enforce_eager is False and engine.cuda_graph_sizes == (1, 2, 4)
    assert engine.kv_cache_memory == 64 << 20
    assert engine.speculative.method == "ngram" and engine.speculative.num_speculative_tokens == 3


def test_the_command_line_wins_over_the_file(tmp_path: Path):
    (tmp_path / "config.yaml").write_text(CONFIG)
    _, engine, server = _parse(["serve", "gemma-3-270m", f"--config={tmp_path / 'config.yaml'}", "--port", "7",
                                "--max_num_seqs", "2", "--enable-prefix-caching"])
    assert engine.model == "gemma-3-270m"  # the positional model replaces the file's, as in vLLM
    assert server.port == 7 and engine.max_num_seqs == 2 and engine.enable_prefix_caching is True
    assert engine.max_model_len == 512  # what the command line leaves out still comes from the file


BAD_FILES = [  # (id, YAML, message)
    ("unknown-key", "port: 1\nno-such-flag: 2\n", "'no-such-flag' is not a flag of `pagedserve serve`"),
    ("not-a-mapping", "- port\n- 1\n", "must be a mapping of flag names to values, got list"),
    ("switch-value", "trust-remote-code: 1\n", "trust-remote-code: expects true or false, got 1"),
    ("list-for-one", "port: [1, 2]\n", "port: expects one value, got [1, 2]"),
    ("no-value", "port:\n", "port: expects a value, got None"),
    ("nested-config", "config: other.yaml\n", "'config' is not a flag of `pagedserve serve`"),
    ("bad-yaml", "port: [1\n", "cannot read it as YAML"),
    ("flag-refuses", "tensor-parallel-size: 2\n", "argument --tensor-parallel-size/-tp: 2: one device per server"),
    ("no-chunked-prefill", "enable-chunked-prefill: false\n", "--no-enable-chunked-prefill: prefills are always"),
]


@pytest.mark.parametrize(("text", "message"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_a_bad_config_file_stops_the_start_naming_what_is_wrong(tmp_path: Path, text, message):
    (tmp_path / "config.yaml").write_text(text)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            code = main(["serve", "--config", str(tmp_path / "config.yaml")])
        except SystemExit as exited:  # argparse's own refusals of a value the file gave
            code = exited.code
    assert code == 2 and message in stderr.getvalue(), stderr.getvalue()


def test_a_missing_config_file_is_named(tmp_path: Path):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(["serve", "--config", str(tmp_path / "absent.yaml")])
    assert code == 2 and "absent.yaml: cannot read it as YAML" in stderr.getvalue()


def test_uvicorn_log_level_sets_the_http_servers_loggers(tmp_path: Path):
    from pagedserve.service.vllm_flags import check_vllm_flags

    uvicorn = logging.getLogger("uvicorn")
    previous = uvicorn.level
    try:
        args, engine, _ = _parse(["serve", "--uvicorn_log_level", "warning", "--disable-uvicorn-access-log"])
        check_vllm_flags(args, engine)
        assert logging.getLogger("uvicorn.error").getEffectiveLevel() == logging.WARNING
        args, engine, _ = _parse(["serve", "--uvicorn-log-level", "trace"])
        check_vllm_flags(args, engine)
        assert logging.getLogger("uvicorn.access").getEffectiveLevel() == 5  # uvicorn's TRACE
    finally:
        uvicorn.setLevel(previous)
