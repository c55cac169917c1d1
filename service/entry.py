"""The `pagedserve` console script and `python -m pagedserve.service`: the OpenMP wait policy before torch loads.

libgomp reads OMP_WAIT_POLICY once, when torch loads it, so a default can only be set before the first torch import;
cli.py imports torch (through the engine config), hence this module. Unset, libgomp spins before it sleeps, and a
2-thread engine beside one busy process fell to 0.11x of its quiet throughput (docs/cpu-threads.md); PASSIVE keeps
0.64x. A value the user set (ACTIVE on dedicated cores) is kept.
"""

from __future__ import annotations

import os

DEFAULT_WAIT_POLICY = "PASSIVE"


def main() -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", DEFAULT_WAIT_POLICY)
    from pagedserve.service.cli import main as cli_main

    return cli_main()
