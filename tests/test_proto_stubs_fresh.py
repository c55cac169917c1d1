"""The committed Python stubs are exactly what proto/generate.py produces from the committed .proto files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "proto" / "generate.py"


def check(script: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), "--check"], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_committed_stubs_are_fresh(tmp_path):
    result = check(SCRIPT, tmp_path)
    assert result.returncode == 0, f"stale generated stubs; run `python proto/generate.py`:\n{result.stderr}"


def test_check_detects_a_stale_stub(tmp_path):
    """The freshness check can fail: edit a copy of the .proto and the copy's stubs no longer match."""
    copy = tmp_path / "proto"
    shutil.copytree(REPO / "proto", copy, ignore=shutil.ignore_patterns("__pycache__"))
    proto = copy / "pagedserve" / "v1" / "tokenize.proto"
    added = "bool return_offsets = 3;\n  uint32 extra = 4;"
    proto.write_text(proto.read_text().replace("bool return_offsets = 3;", added))
    result = check(copy / "generate.py", tmp_path)
    assert result.returncode == 1
    assert "proto/pagedserve/v1/tokenize_pb2.py" in result.stderr
