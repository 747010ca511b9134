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
