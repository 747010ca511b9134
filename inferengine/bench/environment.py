"""The environment of a benchmark run, as text: GPU, driver, torch, CUDA, Python, git, commands."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from inferengine.bench.gpu_trace import describe_gpus
from inferengine.bench.vllm_client import VLLM_PYTHONPATH


def git_revision(cwd: Path | None = None) -> str:
    """`<sha> (clean)` or `<sha> (dirty: N changed, M untracked)`, or why it is unknown."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0:
            return f"unknown ({sha.stderr.strip() or 'not a git checkout'})"
        status = subprocess.run(
            ["git", "status", "--porcelain"], cwd=cwd, capture_output=True, text=True, timeout=10
        ).stdout.splitlines()
        untracked = sum(line.startswith("??") for line in status)
        changed = len(status) - untracked
        dirty = f"dirty: {changed} changed, {untracked} untracked" if status else "clean"
        return f"{sha.stdout.strip()} ({dirty})"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"


def torch_versions() -> str:
    """torch and its CUDA version, imported only here (it is slow to import)."""
    try:
        import torch
    except ImportError:
        return "torch: not installed"
    cuda = torch.version.cuda or "none (CPU build)"
    return f"torch: {torch.__version__}, CUDA: {cuda}"


def cpu_model() -> str:
    """The CPU's model name (a CPU-bound front end's speed follows it), or why it is unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError as e:
        return f"unknown ({e})"
    return platform.processor() or "unknown"


def vllm_version() -> str:
    infos = sorted(Path(VLLM_PYTHONPATH).glob("vllm-*.dist-info"))
    return infos[-1].name.removesuffix(".dist-info") if infos else "not unpacked"


def environment_text(command_lines: dict[str, str], revision: str | None = None) -> str:
    """The whole environment.txt: one `key: value` per line, then every command line run.

    `revision` is what the caller says it measured (a copied checkout may carry a stale .git)."""
    lines = [
        f"date_utc: {datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}",
        *describe_gpus(),
        torch_versions(),
        f"python: {sys.version.split()[0]} ({sys.executable})",
        f"platform: {platform.platform()}",
        f"cpu: {cpu_model()}, {os.cpu_count()} logical cores",
        f"git: {git_revision()}",
        *([f"revision measured (given): {revision}"] if revision else []),
        f"vllm ({VLLM_PYTHONPATH}): {vllm_version()}",
        "",
        "commands:",
    ]
    lines += [f"  {name}: {command}" for name, command in command_lines.items()]
    return "\n".join(lines) + "\n"
