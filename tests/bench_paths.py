"""Puts benchmarks/ and benchmarks/peers/ on sys.path: the harness is scripts, not a package."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
PEERS = BENCH / "peers"
for _p in (str(PEERS), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
