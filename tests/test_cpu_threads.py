"""engine/host/cpu_threads.py: the compute-thread count follows the affinity mask and the cgroup CPU quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagedserve.engine.host.cpu_threads import (
    OPENMP_WAIT_VARS, CpuBudget, apply_thread_budget, cpu_budget, threads_for_quota,
)


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


def _entry_probe(user_env: dict[str, str], cgroup: Path | None = None) -> str:
    """Runs the console script's entry in a fresh interpreter (with --help, so it exits after parsing) and reports
    the OpenMP wait variables the process ended with and whether torch was loaded before the entry set them."""
    import os
    import subprocess
    import sys

    probe = (
        "import atexit, os, sys\n"
        "import pagedserve.service.entry as entry\n"
        "torch_first = 'torch' in sys.modules\n"
        "atexit.register(lambda: print('WAIT', os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'),\n"
        "                              'torch-loaded-first' if torch_first else 'wait-first'))\n"
        "sys.argv = ['pagedserve', '--help']\n"
        "entry.main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT_VARS}
    env.update(user_env)
    enter = (lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None
    out = subprocess.run([sys.executable, "-P", "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                         preexec_fn=enter)
    return [line for line in out.stdout.splitlines() if line.startswith("WAIT")][0]


def test_console_script_sets_the_default_wait_before_torch_loads():
    """libgomp reads the wait variables when torch loads: the default must be in place before any torch import."""
    from pagedserve.engine.host.cpu_threads import cpu_budget
    from pagedserve.service.entry import default_openmp_env

    spins = default_openmp_env(cpu_budget(), {}).get("GOMP_SPINCOUNT")
    assert _entry_probe({}) == f"WAIT None {spins} wait-first"


def test_a_quota_bounds_the_spin_and_nothing_else_is_set():
    """Under a quota the threads poll briefly and then sleep (a bounded spin count, the policy left unset): a native
    decode step's regions are microseconds apart, and PASSIVE's wake-up per region cost 4x at one stream."""
    from pagedserve.kernels.cpu.native import pool_sleeps, spin_count
    from pagedserve.service.entry import QUOTA_SPIN_COUNT, default_openmp_env

    under_quota = default_openmp_env(CpuBudget(affinity=8, quota=2.0), {})
    assert under_quota == {"GOMP_SPINCOUNT": str(QUOTA_SPIN_COUNT)}
    assert spin_count(under_quota) == QUOTA_SPIN_COUNT and not pool_sleeps(under_quota)
    assert spin_count(under_quota) < spin_count({})  # shorter than libgomp's own default
    assert default_openmp_env(CpuBudget(affinity=8, quota=None), {}) == {}


def test_console_script_under_a_real_cpu_quota_sets_the_bounded_spin():
    """The entry reads the quota of the cgroup it really runs in (a container's CPU limit), not a fixture's."""
    import bench_paths  # noqa: F401 - puts benchmarks/ on sys.path
    from contention import QuotaCgroup

    from pagedserve.service.entry import QUOTA_SPIN_COUNT

    try:
        group = QuotaCgroup(1.5)
    except SystemExit as no_cgroup:  # the benchmark's CLI message: no writable cgroup cpu controller
        pytest.skip(str(no_cgroup))
    try:
        assert _entry_probe({}, group.path) == f"WAIT None {QUOTA_SPIN_COUNT} wait-first"
        assert _entry_probe({"OMP_WAIT_POLICY": "PASSIVE"}, group.path) == "WAIT PASSIVE None wait-first"
    finally:
        group.remove()


def test_a_wait_setting_the_user_made_is_kept():
    quota = CpuBudget(affinity=8, quota=1.5)
    from pagedserve.service.entry import default_openmp_env

    for user in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        assert default_openmp_env(quota, user) == {}


def test_console_script_keeps_a_policy_the_user_set():
    assert _entry_probe({"OMP_WAIT_POLICY": "ACTIVE"}) == "WAIT ACTIVE None wait-first"
    assert _entry_probe({"GOMP_SPINCOUNT": "10k"}) == "WAIT None 10k wait-first"
