"""`RayExecutor`: an engine's ranks as Ray actors in one placement group, which may span the
nodes of a cluster (`--distributed-executor-backend ray`).

Ranks are numbered node by node, so that a tensor-parallel group shares a node when it fits one.
The torch.distributed rendezvous is rank 0's node IP and a port free there; commands and
replies go over TCP sockets bound on this node's IP (`RankExecutor`). A thread waits on every
actor's run: a rank that dies (its process killed, its node lost) fails the engine within
about a second, as a dead worker process does.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

from inferengine import envs
from inferengine.config import EngineConfig
from inferengine.executor.rank_executor import RankExecutor, RankExit, send_shutdown
from inferengine.executor.rank_report import RankPlace
from inferengine.executor.ray_cluster import init_ray, place_ranks
from inferengine.executor.ray_worker import RayRankWorker
from inferengine.logger import init_logger

logger = init_logger(__name__)

WATCH_S = 1.0  # how often the watching thread looks whether the executor stopped


class RayExecutor(RankExecutor):
    def __init__(self, config: EngineConfig):
        pc = config.parallel_config
        self.ray = init_ray(pc.ray_address, num_cpus=pc.world_size)
        self.actors: list[Any] = []
        self.group: Any = None
        self.places: list[dict[str, Any]] = []
        self._runs: dict[Any, int] = {}  # each actor's `run` -> its rank
        self._ended: dict[int, RankExit] = {}
        self._stopping = threading.Event()
        super().__init__(config)
        self._finalizer = weakref.finalize(
            self, _release, self.ray, self.actors, self.group, self.cmd_socks, list(self._runs)
        )

    def _start_ranks(self) -> None:
        ray, config = self.ray, self.config
        self.group = place_ranks(ray, self.world_size, config.device)
        actor_cls = ray.remote(RayRankWorker)
        actors = [
            actor_cls.options(**_rank_options(config, self.group, i)).remote()
            for i in range(self.world_size)
        ]
        self.actors.extend(actors)  # stopped on failure, whatever their order
        places = ray.get(
            [a.where.remote() for a in actors], timeout=envs.engine_startup_timeout_s()
        )
        order = sorted(range(len(actors)), key=lambda i: _node_order(places[i]))
        self.actors[:] = [actors[i] for i in order]
        self.places = [places[i] for i in order]
        port = ray.get(self.actors[0].free_port.remote())
        init_method = f"tcp://{self.places[0]['node_ip']}:{port}"
        reply_addr, cmd_addrs = self._bind_sockets(ray.util.get_node_ip_address())
        gpus = _node_gpus(self.places)
        for rank, (actor, where) in enumerate(zip(self.actors, self.places, strict=True)):
            visible = gpus.get(where["node_id"])
            index = visible.index(where["gpu_ids"][0]) if visible else 0
            place = RankPlace(where["node_id"], index, where["node_ip"])
            answers = rank == self.output_rank
            run = actor.run.remote(
                config, rank, init_method, cmd_addrs[rank], reply_addr, answers, place, visible
            )
            self._runs[run] = rank
        logger.info(
            "Ray placed %d ranks on %d node(s); rendezvous at %s",
            self.world_size,
            len({p["node_id"] for p in self.places}),
            init_method,
        )
        threading.Thread(target=self._watch, name="inferengine-ray-ranks", daemon=True).start()

    def _watch(self) -> None:
        """Note each rank whose `run` ends (it died, or stopped at shutdown)."""
        pending = list(self._runs)
        while pending and not self._stopping.is_set():
            done, pending = self.ray.wait(pending, num_returns=1, timeout=WATCH_S)
            for ref in done:
                rank = self._runs[ref]
                self._ended[rank] = self._describe_end(ref, rank)

    def _describe_end(self, ref: Any, rank: int) -> RankExit:
        where = self.places[rank]
        actor = f"rank {rank}'s Ray actor (pid {where['pid']}, node {where['node_ip']})"
        try:
            code = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as e:  # killed, crashed, its node lost
            return RankExit(f"{actor} died: {_first_line(e)}", said_why=False)
        except Exception as e:
            return RankExit(f"{actor} failed: {_first_line(e)}", said_why=False)
        if code:  # it failed, and sent its error first
            return RankExit(f"{actor} failed", said_why=True)
        return RankExit(f"{actor} stopped", said_why=True)

    def _exit_of(self, rank: int) -> RankExit | None:
        return self._ended.get(rank)

    def _stop_ranks(self, grace_s: float) -> None:
        self._stopping.set()
        _release(self.ray, self.actors, self.group, [], list(self._runs), grace_s)
        self.group = None
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()


def _rank_options(config: EngineConfig, group: Any, index: int) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cuda = config.device == "cuda"
    return {
        "num_cpus": 0 if cuda else 1,
        "num_gpus": 1 if cuda else 0,
        "max_restarts": 0,  # a rank cannot rejoin its world: the engine fails instead
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=index
        ),
        "runtime_env": {"env_vars": envs.rank_env()},
    }


def _node_order(where: dict[str, Any]) -> tuple:
    return (
        where["node_ip"],
        where["node_id"],
        [int(g) if g.isdigit() else g for g in where["gpu_ids"]],
    )


def _node_gpus(places: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The GPU ids Ray gave the ranks of each node: every rank there sees all of them."""
    gpus: dict[str, list[str]] = {}
    for where in places:
        gpus.setdefault(where["node_id"], []).extend(where["gpu_ids"])
    return {node: sorted(set(ids), key=lambda g: (len(g), g)) for node, ids in gpus.items() if ids}


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _release(
    ray: Any, actors: list, group: Any, cmd_socks: list, runs: list, grace_s: float = 5.0
) -> None:
    """Ask the ranks to stop (when `cmd_socks` are given), give their runs `grace_s` to end,
    then kill the actors and free the placement group (the finalizer of a dropped executor)."""
    if cmd_socks:
        send_shutdown(cmd_socks)
    if runs and grace_s > 0:
        with contextlib.suppress(Exception):
            ray.wait(runs, num_returns=len(runs), timeout=grace_s)
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)
    if group is not None:
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(group)
