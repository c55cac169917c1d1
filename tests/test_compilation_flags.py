"""vLLM's newer CUDA-graph flags (service/compilation_flags.py): --compilation-config's capture sizes and mode, and
--max-cudagraph-capture-size, parsed into the EngineConfig fields --cuda-graph-sizes and --enforce-eager set (the
graphs themselves: tests/test_cuda_graph_inputs.py here, the device check's cuda_graphs_* cases on a GPU)."""

from __future__ import annotations

import pytest

from pagedserve.engine.errors import ConfigError
from pagedserve.engine.runner.graph_inputs import capture_sizes
from pagedserve.service.cli import build_parser, engine_config


def _engine(*flags: str):
    return engine_config(build_parser().parse_args(["serve", *flags]))


@pytest.mark.parametrize(("flags", "sizes", "eager"), [
    (("--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4, 8]}'), (1, 2, 4, 8), False),
    (("-O", '{"max_cudagraph_capture_size": 32, "cudagraph_mode": "FULL_DECODE_ONLY"}'), (32,), False),
    (("--compilation-config", '{"cudagraph_mode": "NONE", "level": 3}'), (), True),
    (("-O3",), (), False),
    (("--max-cudagraph-capture-size", "16"), (16,), False),
    (("--compilation-config", '{"cudagraph_capture_sizes": [4, 2]}', "--cuda-graph-sizes", "4", "2"), (4, 2), False),
    (("-O", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}', "--no-enforce-eager"), (), False),
])
def test_vllm_graph_flags_set_the_engine_fields(flags, sizes, eager):
    config = _engine(*flags)
    assert config.cuda_graph_sizes == sizes and config.enforce_eager is eager


def test_the_sizes_captured_follow_vllms_rule():
    exactly = _engine("-O", '{"cudagraph_capture_sizes": [1, 3, 24]}').cuda_graph_sizes
    assert capture_sizes(exactly, max_num_seqs=256, largest=512) == (1, 3, 24)
    up_to = _engine("--max-cudagraph-capture-size", "24").cuda_graph_sizes
    assert capture_sizes(up_to, max_num_seqs=256, largest=512) == (1, 2, 4, 8, 16, 24)


@pytest.mark.parametrize(("flags", "field", "message"), [
    (("-O", '{"pass_config": {}}'), "compilation_config.pass_config", "unknown or unsupported key"),
    (("-O", '{"cudagraph_mode": "ALWAYS"}'), "compilation_config.cudagraph_mode", "'ALWAYS'; supported: NONE"),
    (("-O", '{"cudagraph_capture_sizes": []}'), "compilation_config.cudagraph_capture_sizes", "non-empty list"),
    (("-O", '{"cudagraph_capture_sizes": [1, 0]}'), "compilation_config.cudagraph_capture_sizes", "positive"),
    (("-O", '{"max_cudagraph_capture_size": "8"}'), "compilation_config.max_cudagraph_capture_size", "positive"),
    (("-O", "{not json"), "compilation_config", "is not valid JSON"),
    (("-O", '["a"]'), "compilation_config", "must be a JSON object"),
    (("-O", '{"cudagraph_mode": "FULL"}', "--enforce-eager"), "compilation_config.cudagraph_mode",
     "False disagrees with --enforce-eager True"),
    (("--max-cudagraph-capture-size", "8", "--cuda-graph-sizes", "16"), "max_cudagraph_capture_size",
     "(8,) disagrees with --cuda-graph-sizes (16,)"),
])
def test_a_flag_that_cannot_be_honoured_is_refused_naming_the_key(flags, field, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        _engine(*flags)
    assert error.value.field == field
