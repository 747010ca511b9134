"""`--data-parallel-size` and `--ray-address`: parsed, checked, refused where they cannot work."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from inferengine.engine.arg_utils import EngineArgs
from inferengine.entrypoints.cli.main import build_parser, main
from inferengine.errors import ConfigError


def test_the_flags_parse_like_vllms(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    args = build_parser().parse_args(
        ["serve", path, "--data-parallel-size", "2", "--ray-address", "auto"]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    pc = config.parallel_config
    assert (pc.data_parallel_size, pc.ray_address, pc.world_size) == (2, "auto", 1)


def test_sizes_below_one_and_an_address_without_replicas_are_refused():
    with pytest.raises(ConfigError, match="--data-parallel-size must be at least 1, got 0"):
        EngineArgs(model="/nonexistent/model", data_parallel_size=0).create_engine_config()
    with pytest.raises(ConfigError, match="--ray-address places data-parallel replicas"):
        EngineArgs(model="/nonexistent/model", ray_address="auto").create_engine_config()


def test_offline_use_refuses_replicas(tiny_checkpoint):
    from inferengine import LLM

    with pytest.raises(ConfigError, match="inferengine serve --data-parallel-size N"):
        LLM(str(tiny_checkpoint("qwen3")), data_parallel_size=2)


def test_a_missing_ray_says_how_to_install_it(monkeypatch, tiny_checkpoint, capsys):
    from inferengine.dp.ray_backend import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r"pip install 'inferengine\[ray\]'"):
        import_ray()
    # the server refuses to start at once
    path = str(tiny_checkpoint("qwen3"))
    assert main(["serve", path, "--data-parallel-size", "2"]) == 1
    assert "inferengine[ray]" in capsys.readouterr().err


def _config(
    device: str, dp: int = 2, tp: int = 1, address: str | None = None, kv: int | None = None
):
    parallel = SimpleNamespace(data_parallel_size=dp, world_size=tp, ray_address=address)
    cache = SimpleNamespace(kv_cache_memory=kv, num_gpu_blocks_override=None)
    return SimpleNamespace(device=device, parallel_config=parallel, cache_config=cache)


def test_replica_options_ask_for_each_replica_s_devices(monkeypatch):
    from inferengine.dp.ray_backend import replica_options

    assert replica_options(_config("cpu"))["num_cpus"] == 1
    assert "num_gpus" not in replica_options(_config("cpu"))
    assert replica_options(_config("cuda", tp=4))["num_gpus"] == 4
    monkeypatch.setenv("INFERENGINE_LOG_LEVEL", "DEBUG")
    options = replica_options(_config("cuda", address="head:6379"))
    assert options["runtime_env"]["env_vars"]["INFERENGINE_LOG_LEVEL"] == "DEBUG"
    assert options["max_restarts"] > 0


def test_a_cluster_without_enough_gpus_is_refused_at_once():
    from inferengine.dp.ray_backend import gpus_per_replica

    ray = SimpleNamespace(cluster_resources=lambda: {"GPU": 3.0, "CPU": 64.0})
    assert gpus_per_replica(ray, _config("cuda", dp=3)) == 1.0
    with pytest.raises(ConfigError, match="need 4 GPUs; the Ray cluster has 3"):
        gpus_per_replica(ray, _config("cuda", dp=2, tp=2))
    assert gpus_per_replica(ray, _config("cpu", dp=8)) is None


def test_replicas_share_a_gpu_only_with_their_kv_cache_sized():
    from inferengine.dp.ray_backend import gpus_per_replica, replica_options

    one = SimpleNamespace(cluster_resources=lambda: {"GPU": 1.0, "CPU": 16.0})
    with pytest.raises(ConfigError, match="share a GPU when each one's KV cache is sized"):
        gpus_per_replica(one, _config("cuda", dp=2))
    assert gpus_per_replica(one, _config("cuda", dp=2, kv=8 << 30)) == 0.5
    three = SimpleNamespace(cluster_resources=lambda: {"GPU": 2.0, "CPU": 16.0})
    assert gpus_per_replica(three, _config("cuda", dp=3, kv=8 << 30)) == 0.5
    # A replica of several ranks needs whole GPUs.
    with pytest.raises(ConfigError, match="need 4 GPUs; the Ray cluster has 1") as refused:
        gpus_per_replica(one, _config("cuda", dp=2, tp=2, kv=8 << 30))
    assert "share" not in str(refused.value)
    assert replica_options(_config("cuda"), 0.5)["num_gpus"] == 0.5


def test_a_replica_that_cannot_start_is_reported_by_its_error_line():
    from inferengine.dp.ray_backend import _last_line

    ray_text = (
        "The actor died because of an error raised in its creation task, \x1b[36mray::"
        "EngineReplica.__init__()\x1b[39m (pid=1)\n  File 'core.py', line 120\n"
        "inferengine.errors.ConfigError: the KV cache holds 320 tokens\n\n"
    )
    assert _last_line(ray_text) == "inferengine.errors.ConfigError: the KV cache holds 320 tokens"
