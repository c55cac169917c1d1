"""What the structured-output engine tests (test_structured_constraints.py, test_structured_scheduling.py) share:
the schemas services send, constraint shorthands, and the check that a finished batch left no KV block held."""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.engine.constraint import ConstraintKind, OutputConstraint

SCHEMAS: dict[str, dict] = json.loads((Path(__file__).parent / "fixtures" / "service_schemas.json").read_text())


def assert_no_blocks_held(engine) -> None:
    stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def regex(pattern: str) -> OutputConstraint:
    return OutputConstraint(ConstraintKind.REGEX, pattern)


def choice(*options: str) -> OutputConstraint:
    return OutputConstraint(ConstraintKind.CHOICE, choices=options)
