"""`pagedserve serve --structured-outputs-config '<json>'`: vLLM's flag and keys, onto the engine fields that do the
same (`structured_output_backend`, `reasoning_parser`, `constraints_in_reasoning`), so a vLLM command line carries
over; its keys are read by engine/json_configs.py, as LLM(structured_outputs_config=...)'s are."""

from __future__ import annotations

import argparse
from typing import Any

from pagedserve.engine.json_configs import STRUCTURED, structured_outputs_fields as json_fields
from pagedserve.service.engine_flags import json_flag


def add_structured_outputs_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--structured-outputs-config", metavar="JSON",
                        help='vLLM\'s structured-output settings: {"backend": "auto"|"guidance", "reasoning_parser": '
                             'NAME, "enable_in_reasoning": false} (the same as --structured-output-backend, '
                             "--reasoning-parser and --constraints-in-reasoning)")


def structured_outputs_fields(args: argparse.Namespace, given: dict[str, Any]) -> dict[str, Any]:
    """The engine fields the JSON sets; `given`: the fields the other flags set (None: not given)."""
    text = getattr(args, STRUCTURED, None)
    return {} if text is None else json_fields(json_flag(text, STRUCTURED), given)
