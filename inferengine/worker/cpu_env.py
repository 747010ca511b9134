"""What the CPU offers the engine: native bf16 arithmetic, the cores this process may use (its
CPU affinity and cgroup quota), and torch's thread count set from them."""

from __future__ import annotations

import functools
import math
import os
import platform
from pathlib import Path

from inferengine import envs
from inferengine.logger import init_logger

logger = init_logger(__name__)

_X86_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_threads_logged: int | None = None


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first core's feature flags (`flags` on x86, `Features` on Arm); empty if unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """The CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX on x86, BF16 on Arm), so
    bf16 matmuls run at up to twice float32's speed instead of being emulated."""
    flags = cpu_flags() if flags is None else flags
    if flags & _X86_BF16_FLAGS:
        return True
    return platform.machine().lower() in ("aarch64", "arm64") and "bf16" in flags


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
