"""`--distributed-executor-backend` without a cluster: the flag's checks, Ray's address, how
ranks are numbered over nodes and GPUs, and the start-up log's lines for GPU ranks."""

from __future__ import annotations

import argparse

import pytest
import torch

from inferengine import envs
from inferengine.config import ParallelConfig
from inferengine.distributed import parallel_state
from inferengine.engine.arg_utils import EngineArgs
from inferengine.errors import ConfigError
from inferengine.executor.rank_report import log_memory, log_ranks
from tests.conftest import logged_messages


def test_the_flag_takes_mp_or_ray():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["m", "--distributed-executor-backend", "ray", "--ray-address", "x"])
    assert EngineArgs.from_cli_args(args).distributed_executor_backend == "ray"
    assert parser.parse_args(["m"]).distributed_executor_backend == "mp"
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--distributed-executor-backend", "nccl"])
    with pytest.raises(ConfigError, match="must be one of mp, ray; got 'nccl'"):
        ParallelConfig(distributed_executor_backend="nccl")


def test_ray_address_needs_replicas_or_the_ray_executor():
    with pytest.raises(ConfigError, match="--ray-address places data-parallel replicas, or"):
        ParallelConfig(tensor_parallel_size=2, ray_address="auto")
    ParallelConfig(tensor_parallel_size=2, ray_address="auto", distributed_executor_backend="ray")
    with pytest.raises(ConfigError, match="ray places one engine's ranks; data-parallel"):
        ParallelConfig(data_parallel_size=2, distributed_executor_backend="ray")


def test_ray_s_own_address_variable_is_the_default(monkeypatch):
    from inferengine.executor.ray_cluster import cluster_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address(None) is None
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    assert cluster_address(None) == "head:6379"
    assert cluster_address("other:6379") == "other:6379"


def test_ranks_get_the_collectives_settings_but_not_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("INFERENGINE_CPU_KERNELS", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    env = envs.rank_env()
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["INFERENGINE_CPU_KERNELS"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_ranks_are_numbered_node_by_node_and_see_their_node_s_gpus():
    from inferengine.executor.ray_executor import _node_gpus, _node_order

    places = [
        {"node_ip": "10.0.0.2", "node_id": "b", "gpu_ids": ["1"]},
        {"node_ip": "10.0.0.1", "node_id": "a", "gpu_ids": ["10"]},
        {"node_ip": "10.0.0.2", "node_id": "b", "gpu_ids": ["0"]},
        {"node_ip": "10.0.0.1", "node_id": "a", "gpu_ids": ["2"]},
    ]
    order = sorted(range(4), key=lambda i: _node_order(places[i]))
    assert order == [3, 1, 2, 0]  # node a's GPUs 2 and 10, then node b's 0 and 1
    assert _node_gpus(places) == {"a": ["2", "10"], "b": ["0", "1"]}
    assert _node_gpus([{"node_id": "a", "gpu_ids": []}]) == {}  # CPU ranks: nothing to set


def test_all_reduce_by_message_size(monkeypatch):
    class OneShotUpTo2MiB:
        def covers(self, nbytes: int, dtype: torch.dtype) -> bool:
            return nbytes <= 2 << 20

    sizes = [16 << 10, 1 << 20, 4 << 20]
    assert parallel_state.all_reduce_by_size(sizes, torch.bfloat16) == ["none"] * 3
    group = parallel_state.ParallelGroup(0, 2, (0, 1), custom=OneShotUpTo2MiB())
    monkeypatch.setattr(parallel_state, "_tp", group)
    monkeypatch.setattr(parallel_state, "_backend_name", lambda: "NCCL")
    assert parallel_state.all_reduce_by_size(sizes, torch.bfloat16) == [
        "one-shot",
        "one-shot",
        "NCCL",
    ]


def _gpu_info(rank: int, node: str, links: dict[int, str]) -> dict:
    return {
        "node": node,
        "host": f"host-{node}",
        "pid": 100 + rank,
        "device": f"cuda:{rank % 2} NVIDIA H100 80GB HBM3 (bus 0000:{rank:02x}:00.0)",
        "weights_bytes": 70 << 30,
        "attention_backend": "triton",
        "dtype": "bfloat16",
        "links": links,
        "all_reduce_by_size": [["decode x1", 16 << 10, "one-shot"], ["prefill", 64 << 20, "NCCL"]],
    }


def test_the_start_up_log_of_gpu_ranks_on_two_nodes():
    infos = {
        0: _gpu_info(0, "n0", {1: "NVLink", 2: "network", 3: "network"}),
        1: _gpu_info(1, "n0", {0: "NVLink", 2: "network", 3: "network"}),
        2: _gpu_info(2, "n1", {3: "PCIe P2P", 0: "network", 1: "network"}),
        3: _gpu_info(3, "n1", {2: "PCIe P2P", 0: "network", 1: "network"}),
    }
    memory = {"kv_bytes": 5 << 30, "allocated": 76 << 30, "reserved": 77 << 30}
    with logged_messages() as log:
        log_ranks(infos)
        log_memory({0: memory | {"used": 78 << 30, "total": 80 << 30}})
    assert log[0] == (
        "rank 0: node n0 (host-n0), pid 100, cuda:0 NVIDIA H100 80GB HBM3 (bus 0000:00:00.0); "
        "weights 70 GiB, attention triton"
    )
    assert log[4] == (
        "rank links: 0-1 NVLink, 0-2 network, 0-3 network, 1-2 network, 1-3 network, 2-3 PCIe P2P"
    )
    assert log[5] == (
        "tensor-parallel all-reduce (bfloat16) by message size: decode x1 16 KiB: one-shot; "
        "prefill 64 MiB: NCCL"
    )
    assert log[6] == (
        "rank 0 memory: 78 GiB of 80 GiB in use (torch: 76 GiB allocated, 77 GiB reserved), "
        "KV cache 5 GiB"
    )
