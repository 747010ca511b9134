"""The CPU's offer: cores from affinity and cgroup quota, threads."""

from __future__ import annotations

import os

import pytest
import torch

from inferengine.worker import cpu_env


def _cgroup(tmp_path, cpu_max: str | None, nested: str | None = None):
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    proc = tmp_path / "self-cgroup"
    proc.write_text("0::/\n")
    if cpu_max is not None:
        (root / "cpu.max").write_text(cpu_max + "\n")
    if nested is not None:
        (root / "job" / "task").mkdir(parents=True)
        (root / "job" / "cpu.max").write_text(nested + "\n")
        proc.write_text("0::/job/task\n")
    return root, proc


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_available_cores_from_affinity_and_cgroup_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert cpu_env.available_cores(*_cgroup(tmp_path / "a", "max 100000")) == 8
    assert cpu_env.available_cores(*_cgroup(tmp_path / "b", "250000 100000")) == 2
    assert cpu_env.available_cores(*_cgroup(tmp_path / "c", "50000 100000")) == 1
    # A parent's quota binds its children (the tightest wins).
    assert cpu_env.available_cores(*_cgroup(tmp_path / "d", "max 100000", "300000 100000")) == 3
    assert cpu_env.available_cores(*_cgroup(tmp_path / "e", None)) == 8  # no cgroup files
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert cpu_env.available_cores(*_cgroup(tmp_path / "f", "400000 100000")) == 1


def test_threads_follow_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(cpu_env, "available_cores", lambda: 6)
        assert cpu_env.configure_threads() == 6 and torch.get_num_threads() == 6
        assert cpu_env.configure_threads(world_size=4) == 1  # each rank's share, at least 1
        torch.set_num_threads(3)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert cpu_env.configure_threads() == 3 and torch.get_num_threads() == 3  # left alone
    finally:
        torch.set_num_threads(before)


def _v1(tmp_path, folder: str, quota: str, period: str = "100000"):
    root = tmp_path / "cgroup"
    (root / folder).mkdir(parents=True)
    (root / folder / "cpu.cfs_quota_us").write_text(quota + "\n")
    (root / folder / "cpu.cfs_period_us").write_text(period + "\n")
    return root, tmp_path / "no-such-proc-file"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_cgroup_v1_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert cpu_env.available_cores(*_v1(tmp_path / "a", "cpu,cpuacct", "350000")) == 3
    assert cpu_env.available_cores(*_v1(tmp_path / "b", "cpu", "200000", "50000")) == 4
    assert cpu_env.available_cores(*_v1(tmp_path / "c", "cpu", "-1")) == 16  # no limit
    # v2 and v1 files both there: the tighter quota wins.
    root, proc = _v1(tmp_path / "d", "cpu", "600000")
    (root / "cpu.max").write_text("200000 100000\n")
    assert cpu_env.available_cores(root, proc) == 2
    (root / "cpu.max").write_text("garbage\n")  # unreadable: ignored
    assert cpu_env.available_cores(root, proc) == 6


def test_threads_are_logged_once_per_count(monkeypatch):
    before = torch.get_num_threads()
    logged: list[str] = []
    monkeypatch.setattr(cpu_env.logger, "info", lambda m, *a: logged.append(m % a))
    monkeypatch.setattr(cpu_env, "_threads_logged", None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_env, "available_cores", lambda: 4)
    try:
        assert cpu_env.configure_threads() == 4
        assert cpu_env.configure_threads() == 4
        assert cpu_env.configure_threads(world_size=2) == 2
        assert cpu_env.configure_threads(world_size=8) == 1  # never 0
    finally:
        torch.set_num_threads(before)
    assert logged == [
        "CPU threads: 4 (4 available core(s))",
        "CPU threads: 2 (4 available core(s) / 2 ranks)",
        "CPU threads: 1 (4 available core(s) / 8 ranks)",
    ]
