"""`pagedserve serve --speculative-config '<json>'` -> `EngineConfig.speculative` (a `SpeculativeConfig`), with
vLLM's flag and keys (`method`, `num_speculative_tokens`, `prompt_lookup_min`, `prompt_lookup_max`,
`disable_by_batch_size`). Absent: no speculative decoding."""

from __future__ import annotations

import argparse

from pagedserve.engine.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculative decoding (docs/speculative-decoding.md)")
    g.add_argument("--speculative-config", metavar="JSON",
                   help='n-gram prompt lookup, as vLLM configures it: {"method": "ngram", "num_speculative_tokens": '
                        'k, "prompt_lookup_min": a, "prompt_lookup_max": b, "disable_by_batch_size": '
                        f'n}} (a step with more than n running sequences does not speculate; default: '
                        f"{DEFAULT_DISABLE_BY_BATCH_SIZE}); default: off")


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """Raises ConfigError naming the key (`speculative_config.<key>`) for a bad value."""
    text = getattr(args, "speculative_config", None)
    return None if text is None else SpeculativeConfig.from_json(text)
