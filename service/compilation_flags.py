"""vLLM's CUDA-graph flags of its newer releases, onto the engine fields that do the same (`cuda_graph_sizes`,
`enforce_eager`), so those command lines carry over:

- `--compilation-config '<json>'`: `cudagraph_capture_sizes` (exactly those sizes; one size N is 1, 2, 4 and the
  multiples of 8 up to N, a superset, as --cuda-graph-sizes N reads it), `max_cudagraph_capture_size` (1,
  2, 4 and the multiples of 8 up to it), `cudagraph_mode` ("NONE" is --enforce-eager; every other mode captures
  this engine's graphs, which are vLLM's FULL_DECODE_ONLY: whole decode steps, other steps eager). `level` / `mode`
  (torch.compile's optimization level) are accepted and change nothing: the model is never compiled by torch here.
  `-O3` (a bare level) likewise. Other keys are refused naming them (`compilation_config.<key>`); a key that
  disagrees with its own flag too.
- `--max-cudagraph-capture-size N`: the same as `--cuda-graph-sizes N`.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedserve.engine.errors import ConfigError
from pagedserve.service.engine_flags import check_agrees, json_flag_entries

FLAG_FIELD = "compilation_config"
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
_NO_OPS = ("level", "mode")  # torch.compile's optimization level: nothing here is compiled by torch
_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size", "cudagraph_mode", *_NO_OPS)


def add_compilation_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compilation-config", "-O", metavar="JSON",
                        help='vLLM\'s {"cudagraph_capture_sizes": [1, 2, 4], "max_cudagraph_capture_size": N, '
                             '"cudagraph_mode": "NONE" | "FULL_DECODE_ONLY" | ...} (the same as --cuda-graph-sizes '
                             "and --enforce-eager; CUDA only); -O3 (an optimization level) changes nothing here")
    parser.add_argument("--max-cudagraph-capture-size", type=int, metavar="N",
                        help="the same as --cuda-graph-sizes N (vLLM's newer spelling; CUDA only)")


def compilation_fields(args: argparse.Namespace, given: dict[str, Any]) -> dict[str, Any]:
    """The engine fields these flags set; `given`: the fields the other flags set (None: not given)."""
    fields: dict[str, Any] = {}
    if args.max_cudagraph_capture_size is not None:
        fields["cuda_graph_sizes"] = (args.max_cudagraph_capture_size,)
        check_agrees("max_cudagraph_capture_size", "cuda_graph_sizes", fields["cuda_graph_sizes"], given)
    if args.compilation_config is None:
        return fields
    if args.compilation_config.strip().isdigit():
        return fields  # -O3: vLLM's optimization level, torch.compile's: nothing here is compiled by torch
    for key, value in json_flag_entries(args.compilation_config, FLAG_FIELD, _KEYS, _NO_OPS):
        field, value = _field(key, value)
        check_agrees(f"{FLAG_FIELD}.{key}", field, value, {**given, **fields})
        fields[field] = value
    return fields


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _field(key: str, value: Any) -> tuple[str, Any]:
    if key == "cudagraph_mode":
        if value not in CUDAGRAPH_MODES:
            raise ConfigError(f"{FLAG_FIELD}.cudagraph_mode", f"{value!r}; supported: {', '.join(CUDAGRAPH_MODES)}")
        return "enforce_eager", value == "NONE"
    if key == "max_cudagraph_capture_size":
        if not _positive(value):
            raise ConfigError(f"{FLAG_FIELD}.{key}", f"must be a positive integer, got {value!r}")
        return "cuda_graph_sizes", (value,)
    if not isinstance(value, list) or not value or not all(_positive(s) for s in value):
        raise ConfigError(f"{FLAG_FIELD}.{key}", f"must be a non-empty list of positive integers, got {value!r}")
    # Several sizes: exactly those. One size N reads as --cuda-graph-sizes N: vLLM's pattern up to N, a superset.
    return "cuda_graph_sizes", tuple(value)
