"""budget.host_cpus: the loader's threads come from the cores this process may use, not the node's."""
from __future__ import annotations

import pathlib

import pytest

from gpu_worker.checkpoints import budget


@pytest.fixture
def cgroup(tmp_path: pathlib.Path, monkeypatch):
    """Point the cgroup files at a temp dir (none written: no cgroup) and give the process 64
    cores of affinity; returns a writer of the v2 or v1 files."""
    v2 = tmp_path / "cpu.max"
    v1 = (tmp_path / "cpu.cfs_quota_us", tmp_path / "cpu.cfs_period_us")
    monkeypatch.setattr(budget, "_CGROUP_CPU_MAX", str(v2))
    monkeypatch.setattr(budget, "_CGROUP_CPU_V1", tuple(map(str, v1)))
    monkeypatch.setattr(budget.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)

    def write(v2_text: str | None = None, v1_quota: str | None = None, v1_period: str = "100000"):
        if v2_text is not None:
            v2.write_text(v2_text + "\n")
        if v1_quota is not None:
            v1[0].write_text(v1_quota + "\n")
            v1[1].write_text(v1_period + "\n")
    return write


def test_a_kubernetes_cpu_limit_bounds_the_cores_below_the_nodes(cgroup):
    cgroup(v2_text="800000 100000")            # limits.cpu: "8"
    assert budget.cgroup_cpu_quota() == 8.0 and budget.host_cpus() == 8


def test_a_fractional_limit_rounds_up(cgroup):
    cgroup(v2_text="250000 100000")            # 2.5 cores
    assert budget.host_cpus() == 3


def test_no_limit_leaves_the_affinity(cgroup):
    cgroup(v2_text="max 100000")
    assert budget.cgroup_cpu_quota() is None and budget.host_cpus() == 64


def test_no_cgroup_files_leave_the_affinity(cgroup):
    assert budget.cgroup_cpu_quota() is None and budget.host_cpus() == 64


def test_cgroup_v1_quota_is_read_where_v2_is_absent(cgroup):
    cgroup(v1_quota="400000")
    assert budget.host_cpus() == 4
    cgroup(v1_quota="-1")                       # v1's "no limit"
    assert budget.host_cpus() == 64


def test_the_affinity_wins_where_it_is_lower(cgroup, monkeypatch):
    cgroup(v2_text="3200000 100000")
    monkeypatch.setattr(budget.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert budget.host_cpus() == 3
