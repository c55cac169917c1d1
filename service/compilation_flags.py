"""vLLM's CUDA-graph flags of its newer releases, onto the engine fields that do the same (`cuda_graph_sizes`,
`enforce_eager`), so those command lines carry over: `--compilation-config '<json>'` (also `-O`; its keys are read
by engine/json_configs.py, as LLM(compilation_config=...)'s are; `-O3`, a bare level, changes nothing) and
`--max-cudagraph-capture-size N`, the same as `--cuda-graph-sizes N`."""

from __future__ import annotations

import argparse
from typing import Any

from pagedserve.engine.json_configs import COMPILATION, check_agrees, compilation_fields as json_fields
from pagedserve.service.engine_flags import json_flag


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
    text = args.compilation_config.strip()
    config = int(text) if text.isdigit() else json_flag(text, COMPILATION)  # -O3: an optimization level
    return {**fields, **json_fields(config, {**given, **fields})}
