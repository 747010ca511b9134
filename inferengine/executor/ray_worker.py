"""`RayRankWorker`: one rank of an engine as a Ray actor (`ray_executor.py` wraps it; this module
does not import Ray at load), running the same loop as a worker process (`worker_proc.py`)."""

from __future__ import annotations

import os
import socket
from typing import Any

from inferengine import envs
from inferengine.config import EngineConfig
from inferengine.executor.rank_report import RankPlace
from inferengine.executor.worker_proc import serve_rank


class RayRankWorker:
    def where(self) -> dict[str, Any]:
        """This actor's node (Ray's id and IP), host, pid and the GPUs Ray gave it."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        """A port free on this node's IP (rank 0's: the torch.distributed rendezvous)."""
        import ray

        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def run(
        self,
        config: EngineConfig,
        rank: int,
        init_method: str,
        cmd_addr: str,
        reply_addr: str,
        answers_steps: bool,
        place: RankPlace,
        visible_gpus: list[str] | None,
    ) -> int:
        """Serve as rank `rank` until the executor says stop (returns 0), or fail: report why and
        return 1, so that the executor tells a failed rank from a dead one (Ray reports an exit
        and a kill alike); the executor then ends every rank (their world is broken)."""
        if visible_gpus:
            envs.set_visible_gpus(visible_gpus)
        return serve_rank(config, rank, init_method, cmd_addr, reply_addr, answers_steps, place)
