"""Every environment variable InferEngine reads, in one place.

CLI defaults can be given as `INFERENGINE_<FLAG>` (e.g. `INFERENGINE_MAX_MODEL_LEN=4096`); the rest
are for debugging. Nothing else in the package reads `os.environ`.
"""

from __future__ import annotations

import os
from pathlib import Path

CLI_PREFIX = "INFERENGINE_"


def cli_default(flag_dest: str) -> str | None:
    """The environment's value for a CLI flag (`max_model_len` -> `INFERENGINE_MAX_MODEL_LEN`)."""
    return os.environ.get(CLI_PREFIX + flag_dest.upper())


def cache_dir() -> Path:
    """Where downloaded and converted models live (`INFERENGINE_CACHE_DIR`)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "inferengine"
    return Path(os.environ.get("INFERENGINE_CACHE_DIR", default))


def log_level() -> str:
    return os.environ.get("INFERENGINE_LOG_LEVEL", "INFO").upper()


def hf_offline() -> bool:
    """True when the Hugging Face hub must not be contacted (`HF_HUB_OFFLINE=1`)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def triton_interpret() -> bool:
    """Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`, set by kernel tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def engine_startup_timeout_s() -> float:
    return float(os.environ.get("INFERENGINE_ENGINE_STARTUP_TIMEOUT", "900"))


def step_stats_interval_s() -> float:
    """Log per-step timings of the engine core every this many seconds (0: off)."""
    return float(os.environ.get("INFERENGINE_STEP_STATS_INTERVAL", "0"))


def use_pdl() -> bool:
    """Launch Triton kernels with programmatic dependent launch on Hopper and later
    (`INFERENGINE_PDL=0` turns it off, for comparisons)."""
    return os.environ.get("INFERENGINE_PDL", "1") != "0"


def replica_env() -> dict[str, str]:
    """The variables a data-parallel replica on another Ray node must see as this process does:
    ours (`INFERENGINE_*`), the hub's (`HF_*`) and Triton's interpreter switch."""
    forwarded = ("INFERENGINE_", "HF_", "TRITON_INTERPRET")
    return {k: v for k, v in os.environ.items() if k.startswith(forwarded)}


def rank_env() -> dict[str, str]:
    """The variables a rank's Ray actor must see as this process does: a replica's, plus the
    collectives' settings (`NCCL_*`, `GLOO_*`, `NVSHMEM_*`, `TORCH_SYMM_MEM_*`): an interface
    name, NVLink multicast off. Never `CUDA_VISIBLE_DEVICES`: Ray sets each actor's."""
    forwarded = ("NCCL_", "GLOO_", "NVSHMEM_", "TORCH_SYMM_MEM_")
    return replica_env() | {k: v for k, v in os.environ.items() if k.startswith(forwarded)}


def environment_without(names: tuple[str, ...], prefixes: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment less the variables `names` and those starting with a prefix
    in `prefixes` (what the benchmark harness hands to the servers it starts)."""
    return {
        k: v for k, v in os.environ.items() if k not in names and not k.startswith(prefixes or ())
    }


def disable_symm_mem_multicast() -> None:
    """Keep torch's symmetric memory off NVLink multicast (read by torch at each rendezvous;
    the GPU hosts keep multicast off)."""
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"


def ray_address() -> str | None:
    """The Ray cluster to join when `--ray-address` is not given (`RAY_ADDRESS`, Ray's own)."""
    return os.environ.get("RAY_ADDRESS") or None


def set_visible_gpus(ids: list[str]) -> None:
    """Show this process the GPUs `ids` (a Ray rank, before CUDA starts: every rank of a node
    then sees the node's ranks' GPUs, so that peers can map each other's memory)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)


def cpu_kernels() -> str:
    """How our C++ CPU kernels are built (`INFERENGINE_CPU_KERNELS`): "native" (the default,
    for this CPU's instruction sets), "off" (`0`: torch ops instead, for comparisons) or
    "avx2" (without AVX-512 and VNNI, as CPUs that lack them run: for testing that path)."""
    value = os.environ.get("INFERENGINE_CPU_KERNELS", "1").lower()
    return {"1": "native", "0": "off"}.get(value, value)


def omp_num_threads() -> str | None:
    """`OMP_NUM_THREADS` as the user set it (torch reads it too): when set, the engine leaves
    torch's CPU thread count alone."""
    return os.environ.get("OMP_NUM_THREADS")
