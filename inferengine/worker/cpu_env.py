"""What the CPU offers the engine: the cores this process may use (its CPU affinity and cgroup
quota), and torch's thread count set from them."""

from __future__ import annotations

import math
import os
from pathlib import Path

from inferengine import envs
from inferengine.logger import init_logger

logger = init_logger(__name__)

_threads_logged: int | None = None


def available_cores(
    cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (a
    container's `--cpus`) rounded down, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)


def _cgroup_quota(root: Path, proc_cgroup: Path) -> float | None:
    """The tightest CPU quota (in cores) over this process's cgroup and its parents; None when
    there is none. cgroup v2 (`cpu.max`), else v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`)."""
    quotas = []
    for folder in _cgroup_folders(root, proc_cgroup):
        try:
            limit, _, period = (folder / "cpu.max").read_text().strip().partition(" ")
            if limit != "max":
                quotas.append(int(limit) / int(period or 100_000))
        except (OSError, ValueError):
            pass
    for v1 in (root / "cpu,cpuacct", root / "cpu"):
        try:
            limit = int((v1 / "cpu.cfs_quota_us").read_text())
            period = int((v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        if limit > 0 and period > 0:
            quotas.append(limit / period)
        break
    return min(quotas) if quotas else None


def _cgroup_folders(root: Path, proc_cgroup: Path) -> list[Path]:
    """The v2 cgroup of this process and each parent up to `root` (a container sees its own
    cgroup as the root)."""
    folders = [root]
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return folders
    for line in lines:
        if line.startswith("0::"):
            parts = [p for p in line[3:].strip().split("/") if p]
            folders += [root.joinpath(*parts[:i]) for i in range(1, len(parts) + 1)]
    return folders


def configure_threads(world_size: int = 1) -> int:
    """Set torch's intra-op threads to this process's share of the available cores (`world_size`
    CPU ranks share them) unless OMP_NUM_THREADS says otherwise; logged once per count."""
    import torch

    global _threads_logged
    if envs.omp_num_threads():
        threads, why = torch.get_num_threads(), "OMP_NUM_THREADS"
    else:
        cores = available_cores()
        threads = max(1, cores // max(1, world_size))
        torch.set_num_threads(threads)
        why = f"{cores} available core(s)" + (f" / {world_size} ranks" if world_size > 1 else "")
    if _threads_logged != threads:
        logger.info("CPU threads: %d (%s)", threads, why)
        _threads_logged = threads
    return threads
