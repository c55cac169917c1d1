"""The `pagedserve` console script and `python -m pagedserve.service`: the OpenMP wait policy before torch loads.

libgomp reads OMP_WAIT_POLICY once, when torch loads it, so a default can only be set before the first torch import;
cli.py imports torch (through the engine config), hence this module. A value the user set is kept. Otherwise:
- under a cgroup CPU quota (a container CPU limit): PASSIVE. Spinning threads would spend the quota waiting, and
  the CFS throttles the whole process for the rest of its period once it is spent;
- without one: libgomp's own default (spin a while, then sleep), ~10% faster than PASSIVE on a quiet machine. When
  other processes take some of the cores, the engine's thread governor (engine/host/thread_governor.py) runs fewer
  threads, which kept 0.55x of the quiet throughput beside one busy core where the spinning pool alone fell to
  0.34x (docs/cpu-threads.md).
"""

from __future__ import annotations

import os

from pagedserve.engine.host.cpu_threads import CpuBudget, cpu_budget  # torch-free; the engine package loads lazily

QUOTA_WAIT_POLICY = "PASSIVE"


def default_wait_policy(budget: CpuBudget) -> str | None:
    """The policy to set when the user set none (None: leave libgomp's default)."""
    return QUOTA_WAIT_POLICY if budget.quota is not None else None


def main() -> int:
    if "OMP_WAIT_POLICY" not in os.environ:
        policy = default_wait_policy(cpu_budget())
        if policy is not None:
            os.environ["OMP_WAIT_POLICY"] = policy
    from pagedserve.service.cli import main as cli_main

    return cli_main()
