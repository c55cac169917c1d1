"""The `pagedserve` console script and `python -m pagedserve.service`: how the OpenMP threads wait, set before torch
loads.

libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when torch loads it, so a default can only be set before the
first torch import; cli.py imports torch (through the engine config), hence this module. What the user set (either
variable) is kept. Otherwise:
- under a cgroup CPU quota (a container CPU limit): a bounded spin, GOMP_SPINCOUNT=QUOTA_SPIN_COUNT with the policy
  unset. A waiting thread polls for a short while, long enough to catch the next parallel region of the same step
  (a native decode step runs a few hundred of them, microseconds apart), then sleeps, so the time between steps is
  not spent from the quota. PASSIVE, which this used to set, sleeps at once and pays a wake-up (~50-60 us) per
  region: 4x slower decode at one stream under a 1.5-CPU quota (docs/cpu-threads.md);
- without one: libgomp's own default (spin ~300000 polls, then sleep). When other processes take some of the cores,
  the engine's thread governor (engine/host/thread_governor.py) runs fewer threads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# torch-free; the engine package loads lazily
from pagedserve.engine.host.cpu_threads import OPENMP_WAIT_VARS, CpuBudget, cpu_budget

# Polls before a waiting thread sleeps under a quota: ~26 us at the 26 ns a poll takes on Zen 5 (longer on Intel,
# whose pause is slower). 1000 to 30000 were level on the default model and SmolLM2 bf16 under 1.5 and 2 CPUs (all
# 1.0-4.3x PASSIVE's tokens/s); on Gemma 3, which decodes on torch with Python between its regions, the longer counts
# spent more of the quota polling (throttled 4x as long at 10000 as at 1000) for no gain, so the shortest is kept
# (benchmarks/quota_waits.py; docs/cpu-threads.md).
QUOTA_SPIN_COUNT = 1000


def default_openmp_env(budget: CpuBudget, env: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP wait variables to add to `env` (none when the user set either, or no quota applies)."""
    if budget.quota is None or any(name in env for name in OPENMP_WAIT_VARS):
        return {}
    return {"GOMP_SPINCOUNT": str(QUOTA_SPIN_COUNT)}


def main() -> int:
    os.environ.update(default_openmp_env(cpu_budget(), os.environ))
    from pagedserve.service.cli import main as cli_main

    return cli_main()
