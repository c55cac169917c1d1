"""How many compute threads a CPU engine should run: what the process may really use, not what the machine has.

torch sizes its OpenMP pool from the CPU affinity mask, but a container's CPU limit is a CFS quota that no mask
shows: a pod limited to 2 CPUs on a 64-core node would start 64 threads that each get 1/32 of a core, and every
parallel region would wait for the slowest descheduled one. The engine therefore caps its threads at the smaller of
the affinity mask and the cgroup quota (rounded as `threads_for_quota` says, at least one), and logs where the
number came from.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class CpuBudget:
    affinity: int  # CPUs in this process's affinity mask
    quota: float | None  # CPUs the cgroup quota allows (quota / period), None when unlimited

    @property
    def usable(self) -> int:
        if self.quota is None:
            return self.affinity
        return max(1, min(self.affinity, threads_for_quota(self.quota)))

    def describe(self) -> str:
        quota = "no CPU quota" if self.quota is None else f"cgroup quota {self.quota:g} CPUs"
        return f"{self.affinity} CPUs in the affinity mask, {quota}"


# A thread beyond the whole CPUs of a quota is throttled part of each period, and (with PASSIVE waits, which the
# server sets under a quota) costs its peers only the regions that wait on it. Measured on 2 cores, bf16, 32 requests
# (docs/cpu-threads.md, session 10): two threads vs one made -8% under a quota of 1.0 CPU, +19% under 1.25, +34%
# under 1.5. So the extra thread pays once the quota exceeds its whole CPUs by about that 8%; 10% keeps a margin.
ROUND_UP_ABOVE = 0.10


def threads_for_quota(quota: float) -> int:
    """Compute threads for a CFS quota of `quota` CPUs (> 0): its whole CPUs, plus one for a fraction above 10% of
    them (so below one CPU, one)."""
    whole = math.floor(quota)
    return whole + 1 if quota > whole * (1 + ROUND_UP_ABOVE) else whole


def cpu_budget(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> CpuBudget:
    return CpuBudget(affinity=len(os.sched_getaffinity(0)), quota=_cgroup_quota(cgroup_root, proc_cgroup))


def _cgroup_quota(root: Path, proc_cgroup: Path) -> float | None:
    """The tightest CPU quota on the way from this process's cgroup up to the root (v2 `cpu.max`, v1 CFS files)."""
    quotas = [q for q in (_v2_quota(d) for d in _own_dirs(root, proc_cgroup, "")) if q is not None]
    quotas += [q for q in (_v1_quota(d) for d in _own_dirs(root / "cpu", proc_cgroup, "cpu")) if q is not None]
    return min(quotas) if quotas else None


def _own_dirs(root: Path, proc_cgroup: Path, controller: str) -> list[Path]:
    """The process's cgroup directory and its parents up to `root` (v2: the `0::` line; v1: the controller's)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",") if controllers else []
        if (controller in names) if controller else not names:
            leaf = root / path.strip("/")
            return [d for d in (leaf, *leaf.parents) if (d == root or root in d.parents) and d.is_dir()]
    return []


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def apply_thread_budget(requested: int | None, budget: CpuBudget, current: int) -> int:
    """The thread count to use: an explicit request wins; otherwise torch's default capped by what is usable."""
    if requested is not None:
        return requested
    return min(current, budget.usable)


# The variables libgomp decides how its threads wait by, read once when torch loads it (kernels/cpu/native.py's
# spin_count says how).
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def describe_openmp_wait(env: Mapping[str, str]) -> str:
    """How the pool waits, for the log: the variables libgomp read, or that it runs on its default."""
    settings = [f"{name}={env[name]}" for name in OPENMP_WAIT_VARS if name in env]
    return ", ".join(settings) or "OMP_WAIT_POLICY unset: libgomp spins before sleeping"


def configure_cpu_threads(requested: int | None) -> int:
    import torch

    budget = cpu_budget()
    threads = apply_thread_budget(requested, budget, torch.get_num_threads())
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    source = "--num-threads" if requested is not None else budget.describe()
    logger.info("%d compute thread(s) (%s; %s)", threads, source, describe_openmp_wait(os.environ))
    return threads
