"""Ray for data parallelism: one actor per replica, on a cluster joined (or started) by
`executor/ray_cluster.py`.

A local Ray is started on demand (`address="local"`: never another user's instance), or
`--ray-address` joins a cluster so that replicas span its nodes; there every node needs this
package, and the model at the same path (or a hub id it can fetch). Each replica asks for
`tensor_parallel_size x pipeline_parallel_size` GPUs on CUDA (one CPU elsewhere); Ray restarts
a replica whose process dies.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from inferengine import envs
from inferengine.config import EngineConfig
from inferengine.dp.client import ReplicaUnavailable
from inferengine.errors import ConfigError
from inferengine.executor.ray_cluster import cluster_address, init_ray
from inferengine.executor.ray_cluster import import_ray as import_ray  # the server's check
from inferengine.logger import init_logger

logger = init_logger(__name__)

MAX_RESTARTS = 1000  # Ray restarts a dead replica this many times at most


def replica_options(config: EngineConfig, num_gpus: float | None = None) -> dict[str, Any]:
    """Ray actor options of one replica: its devices (`num_gpus`, from `gpus_per_replica`;
    default one per rank), restarts and environment."""
    world_size = config.parallel_config.world_size
    options: dict[str, Any] = {
        "max_restarts": MAX_RESTARTS,
        "max_task_retries": 0,
        "num_cpus": 1,
    }
    if config.device == "cuda":
        options["num_gpus"] = world_size if num_gpus is None else num_gpus
    if cluster_address(config.parallel_config.ray_address):  # other nodes: not this environment
        options["runtime_env"] = {"env_vars": envs.replica_env()}
    return options


def gpus_per_replica(ray: Any, config: EngineConfig) -> float | None:
    """The GPUs each replica asks Ray for (None on the CPU): one per rank, or, when the cluster
    has fewer GPUs than replicas and each replica is one rank, an equal share of one GPU. Shared
    GPUs need each replica's KV cache sized explicitly (--kv-cache-memory or
    --num-gpu-blocks-override): memory profiling would count the other replicas' memory as its
    own. A cluster that cannot hold every replica is refused at once (Ray would wait forever)."""
    if config.device != "cuda":
        return None
    pc, cc = config.parallel_config, config.cache_config
    need = pc.data_parallel_size * pc.world_size
    have = int(ray.cluster_resources().get("GPU", 0))
    if need <= have:
        return float(pc.world_size)
    sized = cc.kv_cache_memory is not None or cc.num_gpu_blocks_override is not None
    if pc.world_size == 1 and have >= 1 and sized:
        per_gpu = math.ceil(pc.data_parallel_size / have)
        logger.info("%d replicas share each of the %d GPU(s)", per_gpu, have)
        return 1.0 / per_gpu
    share = (
        " Replicas of one rank can share a GPU when each one's KV cache is sized with "
        "--kv-cache-memory or --num-gpu-blocks-override."
        if pc.world_size == 1 and have >= 1
        else ""
    )
    raise ConfigError(
        f"--data-parallel-size {pc.data_parallel_size} replicas of {pc.world_size} GPU(s) "
        f"need {need} GPUs; the Ray cluster has {have}. Lower the sizes, or join a larger "
        f"cluster with --ray-address.{share}"
    )


class ReplicaStartError(Exception):
    """A replica's engine raised while it started (the error's last line, its message)."""


def _last_line(text: str) -> str:
    lines = [line for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


class RayReplicaHandle:
    """A `ReplicaHandle` over one `EngineReplica` actor."""

    def __init__(
        self,
        ray: Any,
        actor_cls: Any,
        config: EngineConfig,
        replica_id: int,
        num_gpus: float | None = None,
    ):
        self.ray = ray
        self.replica_id = replica_id
        options = replica_options(config, num_gpus)
        self.actor = actor_cls.options(**options).remote(config, replica_id)

    async def ready(self, timeout: float) -> dict[str, Any]:
        """The replica's info once it serves; `ReplicaUnavailable` while Ray restarts it."""
        try:
            return await asyncio.wait_for(self._await(self.actor.ready.remote()), timeout)
        except self.ray.exceptions.ActorUnavailableError as e:
            raise ReplicaUnavailable(str(e)) from e
        except self.ray.exceptions.RayActorError as e:
            if getattr(e, "actor_init_failed", False):  # the engine could not start: say why
                raise ReplicaStartError(_last_line(str(e))) from e
            raise

    @staticmethod
    async def _await(ref: Any) -> Any:
        return await ref

    def add_requests(self, payload: bytes) -> Awaitable[Any]:
        return self._await(self.actor.add_requests.remote(payload))

    def abort_requests(self, request_ids: list[str]) -> Awaitable[Any]:
        return self._await(self.actor.abort_requests.remote(request_ids))

    async def utility(self, method: str, args: list, timeout: float) -> Any:
        return await asyncio.wait_for(self._await(self.actor.utility.remote(method, args)), timeout)

    async def outputs(self) -> AsyncIterator[list[bytes]]:
        async for ref in self.actor.outputs.remote():
            yield await ref

    def restart(self) -> None:
        """Replace the current incarnation (Ray starts a new one)."""
        self.ray.kill(self.actor, no_restart=False)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine (its worker processes with it), then the actor for good."""
        try:
            self.ray.get(self.actor.shutdown.remote(), timeout=timeout)
        except Exception as e:  # dead or hung: the kill below ends it either way
            logger.debug("replica %d did not stop cleanly: %s", self.replica_id, e)
        self.ray.kill(self.actor, no_restart=True)


def start_replicas(config: EngineConfig) -> list[RayReplicaHandle]:
    """Start (or join) Ray and one replica actor per data-parallel rank; they load at once."""
    from inferengine.dp.replica import EngineReplica

    pc = config.parallel_config
    ray = init_ray(pc.ray_address, num_cpus=pc.data_parallel_size)
    num_gpus = gpus_per_replica(ray, config)
    actor_cls = ray.remote(EngineReplica)
    logger.info(
        "starting %d engine replicas (%d rank(s) each) on Ray",
        pc.data_parallel_size,
        pc.world_size,
    )
    return [
        RayReplicaHandle(ray, actor_cls, config, i, num_gpus) for i in range(pc.data_parallel_size)
    ]
