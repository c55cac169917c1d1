"""engine/host/cpu_threads.py: the compute-thread count follows the affinity mask and the cgroup CPU quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagedserve.engine.host.cpu_threads import CpuBudget, apply_thread_budget, cpu_budget, threads_for_quota


def _tree(tmp_path: Path, files: dict[str, str], proc: str) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "proc_cgroup").write_text(proc)
    return root, tmp_path / "proc_cgroup"


def test_v2_quota_of_a_pod_nested_below_the_root(tmp_path):
    root, proc = _tree(tmp_path, {"kubepods/pod1/ctr/cpu.max": "150000 100000\n", "kubepods/cpu.max": "max 100000\n",
                                  "cpu.max": "max 100000\n"}, "0::/kubepods/pod1/ctr\n")
    budget = cpu_budget(root, proc)
    assert budget.quota == 1.5 and budget.usable == 2  # a throttled second thread still adds (measured)


def test_the_tightest_quota_on_the_path_wins(tmp_path):
    root, proc = _tree(tmp_path, {"a/b/cpu.max": "400000 100000\n", "a/cpu.max": "200000 100000\n"}, "0::/a/b\n")
    assert cpu_budget(root, proc).quota == 2.0


def test_v1_cfs_quota_and_unlimited(tmp_path):
    root, proc = _tree(tmp_path, {"cpu/docker/x/cpu.cfs_quota_us": "300000\n", "cpu/docker/x/cpu.cfs_period_us": "100000\n"},
                       "4:cpu,cpuacct:/docker/x\n3:memory:/docker/x\n")
    assert cpu_budget(root, proc).quota == 3.0
    root, proc = _tree(tmp_path / "u", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
                       "4:cpu,cpuacct:/\n")
    assert cpu_budget(root, proc).quota is None


def test_a_namespaced_container_sees_its_quota_at_the_root(tmp_path):
    root, proc = _tree(tmp_path, {"cpu.max": "50000 100000\n"}, "0::/\n")
    budget = cpu_budget(root, proc)
    assert budget.quota == 0.5 and budget.usable == 1  # never fewer than one thread


@pytest.mark.parametrize("quota, threads", [
    (0.3, 1), (1.0, 1), (1.05, 1), (1.1, 1), (1.11, 2), (1.25, 2), (1.5, 2), (2.0, 2),
    (2.2, 2), (2.25, 3), (4.3, 4), (4.5, 5), (64.0, 64),
])
def test_a_fractional_quota_rounds_up_once_the_fraction_pays(quota, threads):
    """Rounded up only when the fraction exceeds 10% of the whole CPUs (session 10's measurement: a throttled extra
    thread costs ~8%), and capped by the affinity mask."""
    assert threads_for_quota(quota) == threads
    assert CpuBudget(affinity=2, quota=quota).usable == min(2, threads)


def test_no_cgroup_files_means_the_affinity_mask(tmp_path):
    budget = cpu_budget(tmp_path / "none", tmp_path / "missing")
    assert budget == CpuBudget(affinity=len(os.sched_getaffinity(0)), quota=None)


@pytest.mark.parametrize("requested, budget, current, expected", [
    (None, CpuBudget(affinity=64, quota=2.0), 64, 2),   # container limit on a big node
    (None, CpuBudget(affinity=4, quota=None), 4, 4),    # unlimited: torch's own choice
    (None, CpuBudget(affinity=8, quota=16.0), 8, 8),    # quota above the mask: the mask
    (6, CpuBudget(affinity=8, quota=2.0), 8, 6),        # --num-threads always wins
])
def test_thread_count(requested, budget, current, expected):
    assert apply_thread_budget(requested, budget, current) == expected


def _entry_probe(env_policy: str | None) -> str:
    """Runs the console script's entry in a fresh interpreter (with --help, so it exits after parsing) and reports
    the wait policy the process ended with and whether torch was loaded before the entry module set it."""
    import os
    import subprocess
    import sys

    probe = (
        "import atexit, os, sys\n"
        "import pagedserve.service.entry as entry\n"
        "torch_first = 'torch' in sys.modules\n"
        "atexit.register(lambda: print('POLICY', os.environ.get('OMP_WAIT_POLICY'),\n"
        "                              'torch-loaded-first' if torch_first else 'policy-first'))\n"
        "sys.argv = ['pagedserve', '--help']\n"
        "entry.main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-P", "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    return [line for line in out.stdout.splitlines() if line.startswith("POLICY")][0]


def test_console_script_sets_the_default_policy_before_torch_loads():
    """libgomp reads the policy when torch loads: the default must be in place before any torch import."""
    from pagedserve.engine.host.cpu_threads import cpu_budget
    from pagedserve.service.entry import default_wait_policy

    assert _entry_probe(None) == f"POLICY {default_wait_policy(cpu_budget())} policy-first"


def test_default_policy_is_passive_only_under_a_cpu_quota():
    from pagedserve.service.entry import default_wait_policy

    assert default_wait_policy(CpuBudget(affinity=8, quota=2.0)) == "PASSIVE"
    assert default_wait_policy(CpuBudget(affinity=8, quota=None)) is None


def test_console_script_keeps_a_policy_the_user_set():
    assert _entry_probe("ACTIVE") == "POLICY ACTIVE policy-first"
