"""Joining (or starting) a Ray cluster, and placing an engine's ranks on it.

Shared by the data-parallel replicas (`dp/ray_backend.py`) and the Ray executor. A local Ray is
started on demand (`address="local"`: never another user's instance); `--ray-address` or Ray's
own `RAY_ADDRESS` joins a running cluster.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from inferengine import envs
from inferengine.errors import ConfigError
from inferengine.logger import init_logger

logger = init_logger(__name__)

LOCAL_OBJECT_STORE_BYTES = 256 << 20  # frames are small; a local Ray needs little of it
PLACEMENT_TIMEOUT_S = 60.0  # a cluster that has the resources places a group well within it

_ray_thread: threading.Thread | None = None


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ConfigError(
            "--data-parallel-size and --distributed-executor-backend ray place their work with "
            "Ray, which is not installed: pip install 'inferengine[ray]' (or pip install ray)."
        ) from e
    return ray


def cluster_address(address: str | None) -> str | None:
    """The cluster to join: `--ray-address`, else `RAY_ADDRESS`, else None (a local Ray)."""
    return address or envs.ray_address()


def init_ray(address: str | None, num_cpus: int) -> Any:
    """Join the cluster at `address` (or `RAY_ADDRESS`), or start a local Ray (at least
    `num_cpus` logical CPUs).

    Ray ties the processes it starts to the thread that started them (they die with it), so
    `ray.init` runs on a daemon thread that stays parked for the life of the process."""
    global _ray_thread
    ray = import_ray()
    if ray.is_initialized():
        return ray
    address = cluster_address(address)
    done = threading.Event()
    errors: list[BaseException] = []

    def start() -> None:
        try:
            if address:
                ray.init(address=address, include_dashboard=False, log_to_driver=True)
            else:
                ray.init(
                    address="local",
                    num_cpus=max(num_cpus, os.cpu_count() or 1),
                    include_dashboard=False,
                    object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                )
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()
        threading.Event().wait()  # parked: see the docstring

    _ray_thread = threading.Thread(target=start, name="inferengine-ray", daemon=True)
    _ray_thread.start()
    done.wait()
    if errors:
        where = f"the Ray cluster at {address}" if address else "a local Ray"
        raise ConfigError(f"could not start or join {where}: {errors[0]}") from errors[0]
    logger.info("Ray: %s", ray.cluster_resources())
    return ray


def place_ranks(ray: Any, world_size: int, device: str) -> Any:
    """A placement group of one bundle per rank (a GPU on CUDA, else a CPU), packed onto as
    few nodes as hold them. Refused when the cluster lacks the resources, or cannot place them
    within `PLACEMENT_TIMEOUT_S` (others hold them)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    resource = "GPU" if device == "cuda" else "CPU"
    have = ray.cluster_resources().get(resource, 0)
    if have < world_size:
        raise ConfigError(
            f"--tensor-parallel-size × --pipeline-parallel-size is {world_size} ranks of one "
            f"{resource} each; the Ray cluster has {have:g} {resource}(s). Lower the sizes, or "
            "add nodes (ray start --address HEAD:PORT on each)."
        )
    group = placement_group([{resource: 1.0}] * world_size, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise ConfigError(
            f"the Ray cluster could not place {world_size} ranks of one {resource} each within "
            f"{PLACEMENT_TIMEOUT_S:.0f} s: free now {ray.available_resources().get(resource, 0):g} "
            f"{resource}(s) of {have:g}."
        )
    return group
