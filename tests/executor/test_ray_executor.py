"""`LLM(..., distributed_executor_backend="ray")` on a local Ray cluster of two nodes (two
raylets of one CPU each, shared by the module): TP=2 and PP=2 greedy tokens equal one rank's and
Transformers' with the ranks on different nodes, the start-up log names each rank's node and
memory, and a killed rank fails the engine within 5 s."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from inferengine import LLM, SamplingParams
from inferengine.errors import ConfigError, EngineDeadError
from tests.conftest import logged_messages
from tests.executor.test_parallel_engine import SETTINGS, _expected, _generate

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # CI runs these too (the README's command selects no marker)


def start_two_node_cluster():
    """A head node and a second node, one CPU each: two raylets on this machine."""
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 80 << 20}
    cluster = Cluster(initialize_head=True, head_node_args=node | {"include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    return cluster


@pytest.fixture(scope="module")
def cluster():
    cluster = start_two_node_cluster()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    return str(tiny_checkpoint("qwen3"))


@pytest.fixture(scope="module")
def one_rank(qwen3):
    return [o.outputs[0].token_ids for o in _generate(LLM(qwen3, **SETTINGS))]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_ranks_on_two_nodes_keep_one_rank_s_greedy_tokens(cluster, qwen3, one_rank, tp, pp):
    with logged_messages() as log:
        llm = LLM(
            qwen3,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            distributed_executor_backend="ray",
            ray_address=cluster.address,
            **SETTINGS,
        )
    try:
        executor = llm.llm_engine.core.executor
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        placed = [executor.infos[r]["node"] for r in range(2)]
        assert len(set(placed)) == 2 and set(placed) <= nodes  # each rank on its own node
        tokens = [o.outputs[0].token_ids for o in _generate(llm)]
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
        assert tokens == one_rank == _expected(qwen3)
    finally:
        llm.llm_engine.core.shutdown()
    assert f"rank 1: node {placed[1][:12]}" in "\n".join(log)
    assert "rank links: 0-1 network" in log
    assert any(m.startswith("rank 1 memory: RSS ") and "KV cache" in m for m in log)
    expected_path = "gloo" if tp == 2 else "none"
    assert any(
        "all-reduce (float32) by message size: decode x1 256 B: " + expected_path in m for m in log
    )


def test_a_cluster_without_the_cpus_is_refused_at_once(cluster, qwen3):
    with pytest.raises(ConfigError, match=r"4 ranks of one CPU each; the Ray cluster has 2 CPU"):
        LLM(
            qwen3,
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            distributed_executor_backend="ray",
            ray_address=cluster.address,
            max_model_len=128,
        )


def test_a_checkpoint_mistake_in_a_rank_keeps_its_error_class(cluster, qwen3, tmp_path):
    """A rank that cannot load its weights reports the loader's own error, and the ranks and
    their placement group go back to the cluster."""
    from safetensors.torch import load_file, save_file

    from inferengine.errors import ModelLoadError

    for f in Path(qwen3).iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(Path(qwen3) / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"the checkpoint lacks 1 tensors .*model\.norm"):
        LLM(
            str(tmp_path),
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            ray_address=cluster.address,
            max_model_len=128,
        )
    _wait_for_free_cpus(2)


def _wait_for_free_cpus(n: int) -> None:
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == n


def test_killing_a_rank_fails_the_engine_within_5_s(cluster, qwen3):
    llm = LLM(
        qwen3,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        ray_address=cluster.address,
        max_model_len=512,
    )
    executor = llm.llm_engine.core.executor
    killed: list[float] = []

    def kill_soon() -> None:
        time.sleep(1.0)
        killed.append(time.monotonic())
        os.kill(executor.infos[1]["pid"], signal.SIGKILL)

    threading.Thread(target=kill_soon).start()
    params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
    with pytest.raises(EngineDeadError, match=r"rank 1's Ray actor \(pid \d+, node [\d.]+\) died"):
        for _ in range(1000):  # each call runs for a while; the kill lands in one of them
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, params, use_tqdm=False)
    assert time.monotonic() - killed[0] < 5
    with pytest.raises(EngineDeadError):
        llm.generate([{"prompt_token_ids": [5]}], params, use_tqdm=False)
    llm.llm_engine.core.shutdown()
    _wait_for_free_cpus(2)  # the placement group went back to the cluster
