"""The `--router-*` flags: checked at start-up, carried to the router, and its exact decisions
as the weights and the policy change."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inferengine.config import ParallelConfig
from inferengine.core.block_pool import KV_STORED
from inferengine.core.hashing import hash_prompt_blocks
from inferengine.dp.router import Router, RouterConfig
from inferengine.engine.arg_utils import EngineArgs
from inferengine.entrypoints.cli.main import build_parser, main
from inferengine.errors import ConfigError

BS = 4
PROMPT = list(range(10, 26))  # 16 tokens: 4 full blocks
H = hash_prompt_blocks(PROMPT, BS)[:3]  # the 3 a cache could serve (one token left to compute)


def router(n: int = 2, **flags) -> Router:
    """A router as `serve` builds it from these `--router-*` values (as ParallelConfig fields)."""
    engine = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS),
        parallel_config=ParallelConfig(data_parallel_size=n, **flags),
    )
    return Router(n, RouterConfig.from_engine_config(engine))


def stored(hs: list[bytes]) -> list[tuple[int, bytes]]:
    return [(KV_STORED, h) for h in hs]


# ---- start-up checks -----------------------------------------------------------------------


def test_the_flags_parse_and_reach_the_router(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    flags = "--data-parallel-size 2 --router-inflight-weight 4 --router-kv-usage-weight 0"
    args = build_parser().parse_args(["serve", path, *flags.split()])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    pc = config.parallel_config
    assert (pc.router_policy, pc.router_inflight_weight, pc.router_kv_usage_weight) == (
        None,
        4.0,
        0.0,
    )
    rc = RouterConfig.from_engine_config(config)
    assert (rc.policy, rc.load_cost_tokens, rc.kv_usage_cost_tokens, rc.block_size) == (
        "cache-aware",
        4.0,
        0.0,
        16,
    )
    assert rc.cpu_hit_cost == RouterConfig.cpu_hit_cost  # not given: the default


def test_defaults_are_the_router_s_own():
    config = RouterConfig.from_engine_config(
        SimpleNamespace(
            cache_config=SimpleNamespace(block_size=32),
            parallel_config=ParallelConfig(data_parallel_size=2),
        )
    )
    assert config == RouterConfig(block_size=32)
    assert (config.policy, config.load_cost_tokens, config.kv_usage_cost_tokens) == (
        "cache-aware",
        16.0,
        64.0,
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"router_policy": "random"}, "--router-policy must be one of cache-aware, round-robin"),
        ({"router_inflight_weight": -1.0}, "--router-inflight-weight must be a finite number, 0"),
        ({"router_kv_usage_weight": float("nan")}, "--router-kv-usage-weight must be a finite"),
        ({"router_kv_usage_weight": float("inf")}, "--router-kv-usage-weight must be a finite"),
        ({"router_cpu_hit_weight": 1.5}, "--router-cpu-hit-weight must be a number from 0 to 1"),
        ({"router_cpu_hit_weight": -0.1}, "--router-cpu-hit-weight must be a number from 0 to 1"),
        (
            {"router_policy": "round-robin", "router_inflight_weight": 1.0},
            "--router-inflight-weight weigh the cache-aware router's costs; --router-policy "
            "round-robin",
        ),
    ],
)
def test_bad_values_are_refused_naming_what_is_accepted(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        ParallelConfig(data_parallel_size=2, **flags)


def test_every_router_flag_is_refused_without_replicas():
    with pytest.raises(ConfigError) as e:
        EngineArgs(
            model="/nonexistent/model", router_policy="round-robin", router_kv_usage_weight=2.0
        ).create_engine_config()
    assert str(e.value).startswith(
        "--router-policy, --router-kv-usage-weight set how requests are routed between "
        "data-parallel replicas, and one engine has none: give --data-parallel-size 2 or more"
    )
    for flag in ("router_inflight_weight", "router_cpu_hit_weight"):
        with pytest.raises(ConfigError, match="give --data-parallel-size 2 or more"):
            ParallelConfig(**{flag: 0.5})


def test_the_cli_refuses_them_at_start_up(capsys):
    # an unknown policy: argparse names the choices
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--router-policy", "random"])
    assert "choose from 'cache-aware', 'round-robin'" in capsys.readouterr().err
    # without replicas: refused before the model is looked at
    assert main(["serve", "/nonexistent/model", "--router-inflight-weight", "4"]) == 1
    assert "--router-inflight-weight set how requests are routed" in capsys.readouterr().err
    flags = "--data-parallel-size 2 --router-inflight-weight -4"
    assert main(["serve", "/nonexistent/model", *flags.split()]) == 1
    assert "--router-inflight-weight must be a finite number, 0 or more; got -4.0" in (
        capsys.readouterr().err
    )


def test_a_cpu_hit_weight_without_a_cpu_tier_is_refused(tiny_checkpoint):
    args = {"model": str(tiny_checkpoint("qwen3")), "data_parallel_size": 2}
    with pytest.raises(ConfigError, match=r"--router-cpu-hit-weight prices .* add --kv-offloading"):
        EngineArgs(**args, router_cpu_hit_weight=0.5).create_engine_config()
    config = EngineArgs(
        **args, router_cpu_hit_weight=0.5, kv_offloading_size=0.01
    ).create_engine_config()
    assert config.parallel_config.router_cpu_hit_weight == 0.5


# ---- exact decisions as the weights change --------------------------------------------------


@pytest.mark.parametrize(
    ("weight", "costs", "picked"),
    [
        # replica 1 holds 12 of the 16 tokens and has 2 requests in flight
        (0.0, (16.0, 4.0), 1),
        (4.0, (16.0, 12.0), 1),
        (6.0, (16.0, 16.0), 0),  # a tie: fewer in flight
        (8.0, (16.0, 20.0), 0),
    ],
)
def test_the_inflight_weight_trades_cached_tokens_for_load(weight, costs, picked):
    r = router(router_inflight_weight=weight, router_kv_usage_weight=0.0)
    r.apply_kv_events(1, stored(H))
    r.replicas[1].in_flight = 2
    d = r.route("a", H, 16)
    assert d.costs == costs
    assert (d.replica_id, d.reason) == (picked, "prefix" if picked == 1 else "load")


@pytest.mark.parametrize(
    ("weight", "costs", "picked"),
    [
        # replica 0 holds 8 of the 16 tokens and its KV cache is half full; replica 1 is empty
        (0.0, (8.0, 16.0), 0),
        (10.0, (13.0, 16.0), 0),
        (16.0, (16.0, 16.0), 0),  # a tie: equal load and served, the lower id
        (20.0, (18.0, 16.0), 1),
        (64.0, (40.0, 16.0), 1),  # the default
    ],
)
def test_the_kv_usage_weight_trades_cached_tokens_for_a_fuller_cache(weight, costs, picked):
    r = router(router_kv_usage_weight=weight)
    r.apply_kv_events(0, stored(H[:2]))
    r.update_load(0, num_running=1, num_waiting=0, kv_usage=0.5)
    d = r.route("a", H, 16)
    assert d.costs == costs and d.replica_id == picked


def test_round_robin_takes_replicas_in_turn_whatever_they_hold():
    r = router(3, router_policy="round-robin")
    r.apply_kv_events(2, stored(H))
    r.replicas[0].in_flight = 50  # load does not count either
    picks = [r.route(f"r{i}", H, 16) for i in range(4)]
    assert [(d.replica_id, d.reason, d.cached_tokens) for d in picks] == [
        (0, "round_robin", 0),
        (1, "round_robin", 0),
        (2, "round_robin", 12),  # what it held is reported, not sought
        (0, "round_robin", 12),  # r0's prompt is computed there
    ]
    assert picks[0].costs == (0.0, float("inf"), float("inf"))
    r.mark_down(1)  # skipped while down
    assert [r.route(f"s{i}", [], 16).replica_id for i in range(3)] == [2, 0, 2]
    # a session still stays on its replica (its leased pages are there)
    assert r.route("k1", [], 16, session="chat").replica_id == 0
    d = r.route("k2", [], 16, session="chat")
    assert (d.replica_id, d.reason) == (0, "session")
    assert r.route("after", [], 16).replica_id == 2  # the turn was not taken by the session
    r.mark_up(1)
    assert r.route("back", [], 16).replica_id == 0
    assert r.route("back2", [], 16).replica_id == 1
    assert r.decisions == {"round_robin": 11, "session": 1}
