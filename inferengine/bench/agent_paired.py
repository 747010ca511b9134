"""`bench agent`: the agent sessions of `bench/agent.py` against one or several servers, in
alternating rounds, kept as a compact result folder.

Round k launches each system in turn, the order rotated by k as in `bench paired`, waits for
/health, runs the sessions of seed + k and stops the server. Within a round every system gets
the same sessions; each round gets new ones, so a server that stays up across rounds (`url:`)
finds nothing of the last round in its cache. The folder:

    summary.json              the workload, the working set, every run's numbers and cache
                              counters, per system the median and range over the rounds, the
                              ratios of medians (first system / second), the gates
    command.txt               the command line
    environment.txt           GPU, driver, versions, git revision and every server command
    logs/r<k>-<system>.log    each launched server's log, head and tail
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from inferengine.bench.agent import (
    AgentTarget,
    AgentWorkload,
    Session,
    allowed_ids,
    build_sessions,
    format_result,
    run_agent,
)
from inferengine.bench.compact import trim_log
from inferengine.bench.datasets import load_tokenizer
from inferengine.bench.environment import environment_text, git_revision
from inferengine.bench.gates import Gate, evaluate_gate, metric_value, ratio
from inferengine.bench.gpu_trace import describe_gpus
from inferengine.bench.host import child_env
from inferengine.bench.paired import default_out_dir, round_order
from inferengine.bench.paired_launch import SERVER_STATS
from inferengine.bench.runner import jsonable
from inferengine.bench.summary import spread
from inferengine.bench.systems import ServerProcess, SystemSpec, bind_port, wait_until_healthy
from inferengine.errors import ConfigError, InferEngineError

SUMMARY_FORMAT = "inferengine-bench-agent/1"
# metric -> which direction is better; the summary's spreads, ratios and gates cover these.
AGENT_METRICS: dict[str, str] = {
    "later_median_ttft_ms": "lower",
    "later_p99_ttft_ms": "lower",
    "turn1_median_ttft_ms": "lower",
    "turn1_p99_ttft_ms": "lower",
    "median_e2el_ms": "lower",
    "p99_e2el_ms": "lower",
    "output_throughput": "higher",
    "total_token_throughput": "higher",
    "request_throughput": "higher",
    "gpu_hit_rate": "higher",
    "cpu_hit_rate": "higher",
    "hit_rate": "higher",
    "client_hit_rate": "higher",
    "later_client_hit_rate": "higher",
    "duration": "lower",
    "completed": "higher",
    "failed": "lower",
    "ready_s": "lower",
}


@dataclass
class AgentBenchConfig:
    workload: AgentWorkload
    systems: list[SystemSpec]
    tokenizer: str  # whose vocabulary the random prompts are drawn from
    model: str | None = None  # the `model` to send; None: ask each server
    model_dir: str | None = None  # for the KV bytes per token of the working set
    out_dir: Path | None = None
    name: str = "agent"
    gates: list[Gate] = field(default_factory=list)
    repeats: int = 1
    start_repeat: int = 0
    health_timeout_s: float = 900.0
    stop_timeout_s: float = 30.0
    command_line: str = ""
    revision: str | None = None
    api_of: dict[str, str] = field(default_factory=dict)  # system -> API; else completions


def kv_bytes_per_token(model_dir: str | None, dtype_bytes: int = 2) -> int | None:
    """Layers x KV heads x head dim x 2 (K and V) x `dtype_bytes` (bf16), from config.json."""
    try:
        c = json.loads(Path(str(model_dir), "config.json").read_text(encoding="utf-8"))
        c = c.get("text_config", c)
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        kv_heads = c.get("num_key_value_heads") or heads
        return int(c["num_hidden_layers"] * kv_heads * head_dim * 2 * dtype_bytes)
    except (OSError, KeyError, TypeError, ValueError):
        return None


def working_set(w: AgentWorkload, bytes_per_token: int | None) -> dict:
    """The KV the sessions need: all of them at their end, and the active ones at once."""
    per_session = w.mean_final_len()
    active = min(w.sessions, w.max_active_sessions)
    entry: dict = {
        "mean_final_tokens_per_session": per_session,
        "all_sessions_tokens": per_session * w.sessions,
        "active_sessions_tokens": per_session * active,
        "kv_bytes_per_token": bytes_per_token,
        "kv_bytes_per_token_assumes": "bf16 KV, from --model-dir's config.json",
    }
    if bytes_per_token:
        entry["all_sessions_gib"] = per_session * w.sessions * bytes_per_token / 2**30
        entry["active_sessions_gib"] = per_session * active * bytes_per_token / 2**30
    return entry


def run_agent_bench(cfg: AgentBenchConfig) -> int:
    """Every round on every system; the folder; 0 when every run worked and every gate passed."""
    names = [s.name for s in cfg.systems]
    if not names or len(set(names)) != len(names):
        raise ConfigError("give each --system a different NAME")
    if cfg.repeats < 1 or cfg.start_repeat < 0:
        raise ConfigError("--repeats must be at least 1 and --start-repeat at least 0")
    cfg.workload.check()
    tokenizer = load_tokenizer(cfg.tokenizer)
    ids = allowed_ids(tokenizer)
    out = cfg.out_dir or default_out_dir(cfg.name)
    out.mkdir(parents=True, exist_ok=True)
    print(f"Results go to {out}")
    rounds = list(range(cfg.start_repeat, cfg.start_repeat + cfg.repeats))
    runs = []
    # SIGTERM (a time limit) unwinds like Ctrl-C, so that the server being measured is stopped.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        for k in rounds:
            workload = dataclasses.replace(cfg.workload, seed=cfg.workload.seed + k)
            sessions = build_sessions(workload, ids)
            for position, spec in enumerate(round_order(cfg.systems, k)):
                run = run_system(
                    spec, k, position, workload, sessions, ids, cfg, out, tokenizer.decode
                )
                runs.append(run)
    finally:
        signal.signal(signal.SIGTERM, previous)

    summary = build_summary(cfg, runs, rounds)
    (out / "summary.json").write_text(json.dumps(jsonable(summary), indent=1), encoding="utf-8")
    (out / "command.txt").write_text(cfg.command_line + "\n", encoding="utf-8")
    commands = {"agent": cfg.command_line}
    for run in runs:
        commands[f"r{run['repeat']} {run['system']} server"] = run["command"] or (
            f"(already running at {run['base_url']})"
        )
    (out / "environment.txt").write_text(environment_text(commands, cfg.revision), encoding="utf-8")
    print(format_summary(summary))
    for error in summary["errors"]:
        print(f"error: {error}")
    print(f"Wrote {out}")
    return 0 if summary["passed"] else 1


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_system(
    spec: SystemSpec,
    k: int,
    position: int,
    workload: AgentWorkload,
    sessions: Sequence[Session],
    ids: np.ndarray,
    cfg: AgentBenchConfig,
    out: Path,
    decode: Callable[[list[int]], str] | None = None,
) -> dict:
    """Launch (or reach) one system, run the sessions on it (through its API), stop it."""
    command, base_url = bind_port(spec)
    log_path = out / "logs" / f"r{k}-{spec.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    run: dict = {
        "repeat": k,
        "position": position,
        "system": spec.name,
        "api": cfg.api_of.get(spec.name, "completions"),
        "command": command,
        "base_url": base_url,
        "ready_s": None,
        "error": None,
        "result": None,
    }
    server = None
    try:
        if command:
            print(f"[r{k} {spec.name}] starting: {command}")
            server = ServerProcess(command, log_path, child_env(vllm=spec.preset == "vllm"))
        ready_s = wait_until_healthy(base_url, cfg.health_timeout_s, server)
        if server is not None:
            run["ready_s"] = ready_s
            print(f"[r{k} {spec.name}] ready after {ready_s:.1f} s")
        target = AgentTarget(
            base_url,
            spec.model or cfg.model,
            spec.extra_body,
            spec.send_ignore_eos,
            api=run["api"],
            decode=decode,
        )
        result = asyncio.run(run_agent(workload, target, sessions, ids))
        run["result"] = result
        print(f"[r{k} {spec.name}] {format_result(result)}")
        if result["failed"]:
            run["error"] = f"{result['failed']} turns failed: {result['errors'][:2]}"
    except (InferEngineError, OSError, subprocess.SubprocessError, aiohttp.ClientError) as e:
        run["error"] = f"{type(e).__name__}: {e}"
        print(f"[r{k} {spec.name}] failed: {run['error']}")
    finally:
        if server is not None:
            server.stop(cfg.stop_timeout_s)
            trim_log(log_path, keep=SERVER_STATS)
        elif not log_path.exists():
            log_path.write_text(f"# {spec.name} was already running at {base_url}\n")
    run["metrics"] = run_metrics(run)
    return run


def run_metrics(run: dict) -> dict[str, float | None]:
    """The summary's numbers of one run: the client's, the cache's hit rates, ready_s."""
    flat = {**(run["result"] or {}), **((run["result"] or {}).get("cache") or {})}
    flat["ready_s"] = run["ready_s"]
    return {m: metric_value(flat, m) for m in AGENT_METRICS}


def build_summary(cfg: AgentBenchConfig, runs: Sequence[dict], rounds: Sequence[int]) -> dict:
    systems = [s.name for s in cfg.systems]
    by_system = {}
    for name in systems:
        mine = [r for r in runs if r["system"] == name]
        by_system[name] = {m: spread([r["metrics"][m] for r in mine]) for m in AGENT_METRICS}
    medians = {n: {m: s["median"] for m, s in by_system[n].items()} for n in systems}
    ratios = {}
    if len(systems) >= 2:
        a, b = systems[0], systems[1]
        ratios = {m: ratio(medians[a][m], medians[b][m]) for m in AGENT_METRICS}
    verdicts = [evaluate_gate(g, medians, systems) for g in cfg.gates]
    errors = [f"r{r['repeat']} {r['system']}: {r['error']}" for r in runs if r["error"]]
    gates_passed = all(v["passed"] for v in verdicts)
    return {
        "format": SUMMARY_FORMAT,
        "name": cfg.name,
        "client": "inferengine bench agent",
        "revision": cfg.revision or git_revision(),
        "gpu": describe_gpus()[0],
        "model_dir": cfg.model_dir,
        "tokenizer": cfg.tokenizer,
        "workload": dataclasses.asdict(cfg.workload),
        "seeds": {k: cfg.workload.seed + k for k in rounds},
        "working_set": working_set(cfg.workload, kv_bytes_per_token(cfg.model_dir)),
        "systems": systems,
        "apis": {name: cfg.api_of.get(name, "completions") for name in systems},
        "rounds": {k: [s.name for s in round_order(cfg.systems, k)] for k in rounds},
        "better": AGENT_METRICS,
        "spread": by_system,
        "ratios": ratios,
        "ratio_of": f"{systems[0]}/{systems[1]}" if len(systems) >= 2 else None,
        "runs": list(runs),
        "gates": verdicts,
        "errors": errors,
        "gates_passed": gates_passed,
        "passed": gates_passed and not errors,
    }


def format_summary(summary: dict) -> str:
    """Medians with [min-max] over the rounds per system, the ratio, then the gates."""
    systems = summary["systems"]
    head = f"{'metric':<24}" + "".join(f"{s[:24]:>26}" for s in systems) + f"{'ratio':>9}"
    lines = [head, "-" * len(head)]
    for metric in AGENT_METRICS:
        cells = ""
        for name in systems:
            s = summary["spread"][name][metric]
            text = "-" if s["median"] is None else f"{s['median']:.3f}"
            if s["n"] > 1:
                text += f" [{s['min']:.3f}-{s['max']:.3f}]"
            cells += f"{text:>26}"
        r = summary["ratios"].get(metric)
        lines.append(f"{metric:<24}{cells}{'' if r is None else f'{r:9.3f}'}")
    for v in summary["gates"]:
        value = "n/a" if v["value"] is None else f"{v['value']:.4g}"
        why = f" ({v['error']})" if v["error"] else ""
        lines.append(f"gate {'PASS' if v['passed'] else 'FAIL'}: {v['gate']}  [{v['target']} = {value}]{why}")  # fmt: skip
    return "\n".join(lines)
