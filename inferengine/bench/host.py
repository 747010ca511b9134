"""What a paired run does on the host outside the measured windows: child environments, the GPU
probe (in a subprocess, so the harness never holds a CUDA context), the GPU's processes.

Nothing here runs while the judge measures: the probe runs once before any server starts, the
process listing once before each launch.

    python -m inferengine.bench.host probe   # {"copy_gbps": ..., "bf16_matmul_tflops": ...}
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from inferengine import envs

# Set by the GPU scripts for the harness's own output; a user's shell does not have them.
HARNESS_ONLY_VARS = ("PYTHONUNBUFFERED",)
# vLLM's side gets none of ours; the vLLM variables it needs are on its command line.
NOT_FOR_VLLM_PREFIXES = ("INFERENGINE_", "VLLM_")
PROBE_TIMEOUT_S = 300.0


def child_env(vllm: bool) -> dict[str, str]:
    """The environment of a server or judge process: the harness's, less what only the harness
    sets, and for vLLM's processes less our and vLLM's variables (its command line sets those
    that peers/vllm-serve.sh sets), so vLLM runs as it does started by hand."""
    return envs.environment_without(HARNESS_ONLY_VARS, NOT_FOR_VLLM_PREFIXES if vllm else ())


def has_nvidia_device() -> bool:
    return Path("/dev/nvidiactl").exists()


def probe_device(python: str = sys.executable) -> dict:
    """The GPU's copy bandwidth and bf16 matmul peak, measured in a child process (its CUDA
    context ends with it); Nones with the reason on a machine without an NVIDIA device."""
    if not has_nvidia_device():
        return {"copy_gbps": None, "bf16_matmul_tflops": None, "reason": "no NVIDIA device"}
    argv = [python, "-m", "inferengine.bench.host", "probe"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        return {"copy_gbps": None, "bf16_matmul_tflops": None, "reason": f"probe failed: {e}"}


def gpu_processes() -> list[str] | None:
    """`pid, used memory` of every compute process on the GPUs (one nvidia-smi call), or None
    without nvidia-smi: a process left by the previous server shows here."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def _probe() -> dict:
    from inferengine.bench.bandwidth import copy_bandwidth_gbps
    from inferengine.bench.mfu import PEAK_REPEATS, PEAK_SIZE, bf16_matmul_peak_tflops

    return {
        "copy_gbps": copy_bandwidth_gbps(),
        "bf16_matmul_tflops": bf16_matmul_peak_tflops(),
        "bf16_matmul": f"{PEAK_SIZE}^3, best of {PEAK_REPEATS}",
    }


if __name__ == "__main__":
    if sys.argv[1:] != ["probe"]:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    print(json.dumps(_probe()))
