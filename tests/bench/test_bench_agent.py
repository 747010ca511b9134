"""`bench agent`: the session generator (deterministic, conversations that extend exactly, think
times of the asked mean), the cache counters, and whole runs against the fake server and a CPU
server with a tiny checkpoint."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from inferengine.bench.agent import (
    AgentWorkload,
    allowed_ids,
    build_sessions,
    cache_summary,
    parse_prometheus,
    think_times,
)
from inferengine.entrypoints.cli.main import main
from inferengine.errors import ConfigError

IDS = np.arange(2, 400)
SMALL = AgentWorkload(
    sessions=5,
    turns=4,
    prefix_len=40,
    shared_prefix_len=16,
    tool_len_min=20,
    tool_len_max=30,
    output_len=6,
    think_time_s=0.5,
    session_gap_s=0.2,
    max_active_sessions=2,
    seed=3,
)


def test_sessions_are_deterministic_and_depend_on_the_seed():
    a, b = build_sessions(SMALL, IDS), build_sessions(SMALL, IDS)
    assert [s.id for s in a] == [f"agent-3-{i:04d}" for i in range(5)]
    for x, y in zip(a, b, strict=True):
        assert x.start_s == y.start_s and x.turns == y.turns
        assert all(x.prompt(t) == y.prompt(t) for t in range(1, 5))
    other = build_sessions(dataclasses.replace(SMALL, seed=4), IDS)
    assert other[0].prompt(1) != a[0].prompt(1)
    # Session i depends on (seed, i) only: more sessions leave the first ones as they were.
    more = build_sessions(dataclasses.replace(SMALL, sessions=8), IDS)
    assert [s.prompt(4) for s in more[:5]] == [s.prompt(4) for s in a]


def test_each_turn_extends_the_last_by_a_reply_and_a_tool_output():
    sessions = build_sessions(SMALL, IDS)
    allowed = set(IDS.tolist())
    for s in sessions:
        assert len(s.turns) == 4 and s.turns[0].think_s == 0.0
        assert s.prompt(1)[:16] == sessions[0].prompt(1)[:16]  # the shared system prompt
        for turn in s.turns:
            prompt = s.prompt(turn.index)
            assert len(prompt) == turn.prompt_len and set(prompt) <= allowed
            assert all(type(i) is int for i in prompt)
            if turn.index == 1:
                assert turn.prompt_len == SMALL.prefix_len
                continue
            before = s.prompt(turn.index - 1)
            assert prompt[: len(before)] == before
            added = len(prompt) - len(before) - SMALL.output_len
            assert SMALL.tool_len_min <= added <= SMALL.tool_len_max and turn.think_s > 0
    # Only the shared part is shared.
    assert sessions[0].prompt(1)[16:] != sessions[1].prompt(1)[16:]
    starts = [s.start_s for s in sessions]
    assert starts[0] == 0.0 and starts == sorted(starts) and starts[-1] > 0
    assert max(len(s.prompt(4)) for s in sessions) <= SMALL.max_prompt_len


@pytest.mark.parametrize("distribution", ["exponential", "lognormal", "fixed"])
def test_think_times_have_the_asked_mean(distribution):
    draws = think_times(np.random.default_rng(0), 200_000, 2.5, distribution, sigma=0.8)
    assert draws.min() >= 0
    assert abs(draws.mean() - 2.5) < 0.025 * 2.5
    if distribution == "fixed":
        assert set(draws.tolist()) == {2.5}
    # Over the generator: every session's later turns draw from the same distribution.
    w = dataclasses.replace(SMALL, sessions=2000, turns=3, think_distribution=distribution)
    thinks = [t.think_s for s in build_sessions(w, IDS) for t in s.turns[1:]]
    assert abs(np.mean(thinks) - 0.5) < 0.06 * 0.5


def test_bad_workloads_are_refused():
    for bad in (
        dict(shared_prefix_len=41),
        dict(tool_len_min=0),
        dict(turns=0),
        dict(think_distribution="gamma"),
        dict(think_sigma=0.0),
    ):
        with pytest.raises(ConfigError):
            build_sessions(dataclasses.replace(SMALL, **bad), IDS)


def test_allowed_ids_leave_out_special_tokens(tokenizer):
    ids = allowed_ids(tokenizer)
    assert len(ids) == tokenizer.vocab_size - len(set(tokenizer.all_special_ids))
    assert not set(ids.tolist()) & set(tokenizer.all_special_ids)


VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 400.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 300.0
vllm:kv_offload_load_bytes_total{engine="0",model_name="m"} 4096.0
vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 4096.0
process_cpu_seconds_total 12.5
"""


def test_vllm_counters_give_gpu_and_cpu_hit_rates():
    after = parse_prometheus(VLLM_METRICS)
    assert after == {
        "prefix_cache_queries_total": 1500.0,
        "prefix_cache_hits_total": 600.0,
        "external_prefix_cache_queries_total": 400.0,
        "external_prefix_cache_hits_total": 300.0,
        "kv_offload_load_bytes_total": 4096.0,
    }
    before = {"prefix_cache_queries_total": 500.0, "prefix_cache_hits_total": 100.0}
    c = cache_summary(before, after)
    assert c["source"] == "/metrics" and c["query_tokens"] == 1000.0
    assert c["gpu_hit_rate"] == 0.5 and c["cpu_hit_rate"] == 0.3 and c["hit_rate"] == 0.8
    assert c["loaded_bytes"] == 4096.0 and c["offloaded_bytes"] is None
    # Our namespace reads the same; a server without a CPU tier has no CPU figures.
    ours = parse_prometheus(VLLM_METRICS.replace("vllm:", "inferengine:"))
    assert ours["prefix_cache_hits_total"] == 600.0
    assert cache_summary({}, {"prefix_cache_queries_total": 10.0})["cpu_hit_rate"] is None


def test_our_kv_tiers_take_precedence_and_gauges_keep_their_last_value():
    before = {
        "tier.query_tokens": 100.0,
        "tier.gpu_hit_tokens": 50.0,
        "tier.sessions": 9.0,
        "tier.cpu_hit_tokens": 0.0,
        "prefix_cache_queries_total": 100.0,
    }
    after = {
        "tier.query_tokens": 1100.0,
        "tier.gpu_hit_tokens": 450.0,
        "tier.sessions": 4.0,
        "tier.cpu_hit_tokens": 400.0,
        "tier.loaded_bytes": 64.0,
        "prefix_cache_queries_total": 1100.0,
    }
    c = cache_summary(before, after)
    assert c["source"] == "/stats kv_tiers"
    assert (c["gpu_hit_rate"], c["cpu_hit_rate"], c["hit_rate"]) == (0.4, 0.4, 0.8)
    assert c["counters"]["tier.sessions"] == 4.0 and c["loaded_bytes"] == 64.0
    assert cache_summary({}, {})["source"] is None


def agent_argv(out: Path, tokenizer: Path, *systems: str, **flags) -> list[str]:
    argv = ["bench", "agent", *systems, "--tokenizer", str(tokenizer), "--out-dir", str(out)]
    settings = dict(
        sessions=3,
        turns=3,
        prefix_len=40,
        tool_len="20:30",
        output_len=4,
        think_time=0.05,
        session_gap=0.02,
        max_active_sessions=2,
        num_warmups=2,
    )
    for k, v in {**settings, **flags}.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def run_cli(argv: list[str]) -> int:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "pynvml", None)  # NVML absent, also on a GPU machine
        return main(argv)


def test_against_the_fake_server_every_turn_is_sent_as_generated(
    fake_server, tokenizer_dir, tmp_path
):
    server = fake_server(ttft_ms=1, token_delay_ms=1)
    code = run_cli(
        agent_argv(
            tmp_path,
            tokenizer_dir,
            "--url",
            server.base_url,
            "--label",
            "fake",
            "--gate",
            "failed<=0@fake",
            "--gate",
            "hit_rate>=0.99@fake",
        )
    )
    assert code == 1  # the second gate fails: the fake caches only prompts, not replies
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [g["passed"] for g in summary["gates"]] == [True, False]
    bodies = server.state.bodies[2:]  # after the two warm-ups
    assert len(bodies) == 9 and server.state.max_active <= 2
    w = AgentWorkload(
        sessions=3, turns=3, prefix_len=40, tool_len_min=20, tool_len_max=30, output_len=4
    )
    from inferengine.bench.datasets import load_tokenizer

    sessions = build_sessions(w, allowed_ids(load_tokenizer(str(tokenizer_dir))))
    expected = {(s.id, tuple(s.prompt(t.index))) for s in sessions for t in s.turns}
    assert {(b["prompt_cache_key"], tuple(b["prompt"])) for b in bodies} == expected
    assert {b["prompt_cache_retention"] for b in bodies} == {"1h"}
    assert {(b["max_tokens"], b["ignore_eos"], b["temperature"], b["stream"]) for b in bodies} == {
        (4, True, 0.0, True)
    }
    assert "prompt_cache_key" not in server.state.bodies[0]  # warm-ups belong to no session
    result = summary["runs"][0]["result"]
    assert result["completed"] == 9 and result["num_turn1"] == 3 and result["num_later"] == 6
    assert result["total_output_tokens"] == 36
    assert set(result["median_ttft_ms_by_turn"]) == {"1", "2", "3"}
    cache = result["cache"]
    assert cache["source"] == "/metrics" and cache["query_tokens"] == sum(
        len(b["prompt"]) for b in bodies
    )
    assert 0 < cache["gpu_hit_rate"] < 1 and cache["cpu_hit_rate"] is None
    assert result["client_hit_rate"] is None  # the fake reports no cached_tokens


@pytest.mark.slow
def test_bench_agent_against_a_cpu_server(tiny_checkpoint, tmp_path):
    """Two sessions x three turns through `inferengine serve` on the CPU, launched as a system."""
    model = tiny_checkpoint("qwen2")
    system = (
        "ours=preset:inferengine --device cpu --kv-cache-memory 64MiB --max-model-len 512 "
        "--disable-log-requests --uvicorn-log-level warning"
    )
    argv = agent_argv(
        tmp_path / "out",
        model,
        "--system",
        system,
        "--model-dir",
        str(model),
        "--served-model-name",
        "tiny",
        sessions=2,
        tool_len="16:32",
    )
    assert run_cli(argv) == 0
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "command.txt",
        "environment.txt",
        "logs",
        "summary.json",
    ]
    assert (out / "command.txt").read_text().startswith("inferengine")
    assert "git:" in (out / "environment.txt").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and summary["errors"] == [] and summary["systems"] == ["ours"]
    run = summary["runs"][0]
    assert run["ready_s"] > 0 and run["error"] is None
    result = run["result"]
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 24
    for key in (
        "turn1_median_ttft_ms",
        "turn1_p99_ttft_ms",
        "later_median_ttft_ms",
        "later_p99_ttft_ms",
        "output_throughput",
        "total_token_throughput",
    ):
        assert result[key] > 0, key
        assert summary["spread"]["ours"].get(key, {"n": 1})["n"] == 1
    # Turn 2 resends turn 1 (40 tokens): the server finds at least its first two blocks.
    assert result["cache"]["gpu_hit_tokens"] >= 2 * 32
    # ... and says so in each reply's usage: turn 1 hits nothing, later turns do.
    assert result["num_cached_tokens_reported"] == 6
    assert 0 < result["client_hit_rate"] < result["later_client_hit_rate"] < 1
    assert not any(isinstance(v, list) for v in result.values() if v)  # no per-request arrays


def test_two_systems_alternate_and_get_the_same_sessions_each_round(tokenizer_dir, tmp_path):
    from test_bench_paired import fake_command

    fast, slow = fake_command(ttft_ms=1), fake_command(ttft_ms=30)
    argv = agent_argv(
        tmp_path,
        tokenizer_dir,
        "--system",
        f"A={fast}",
        "--system",
        f"B={slow}",
        "--repeats",
        "2",
        "--stop-timeout",
        "5",
        "--seed",
        "7",
        "--gate",
        "later_median_ttft_ms<=0.5",
        "--gate",
        "completed>=1.0",
        sessions=2,
        turns=2,
    )
    assert run_cli(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds"] == {"0": ["A", "B"], "1": ["B", "A"]}
    assert summary["seeds"] == {"0": 7, "1": 8} and summary["ratio_of"] == "A/B"
    runs = summary["runs"]
    assert [(r["repeat"], r["system"]) for r in runs] == [(0, "A"), (0, "B"), (1, "B"), (1, "A")]
    by_round = {}
    for r in runs:
        assert r["error"] is None and r["ready_s"] > 0
        by_round.setdefault(r["repeat"], set()).add(r["result"]["total_input_tokens"])
    # Within a round both systems got the same prompts; the rounds got different ones.
    assert all(len(v) == 1 for v in by_round.values()) and by_round[0] != by_round[1]
    assert summary["spread"]["A"]["later_median_ttft_ms"]["n"] == 2
    assert summary["ratios"]["later_median_ttft_ms"] < 0.5
    assert [g["passed"] for g in summary["gates"]] == [True, True]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "r0-A.log",
        "r0-B.log",
        "r1-A.log",
        "r1-B.log",
    ]
