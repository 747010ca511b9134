"""`bench paired`: one workload against several servers in turn, with GPU traces, ratios and gates.

For each system: launch its server (or take a running one), wait for /health and note the ready
time, run `bench serve` with the same prompts and seed (and optionally vLLM's client), stop the
server; NVML samples the GPU throughout. The folder gets `<system>.json`, `<system>.log`,
`<system>-gpu.csv`, `environment.txt` and `comparison.json`.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from inferengine.bench.bandwidth import copy_bandwidth_gbps
from inferengine.bench.config import ServeConfig, WorkloadConfig
from inferengine.bench.datasets import SampleRequest, load_tokenizer, sample_requests
from inferengine.bench.environment import environment_text
from inferengine.bench.gates import (
    HEADLINE_METRICS,
    Gate,
    build_comparison,
    collect_values,
    format_comparison,
    metric_value,
    ratio,
)
from inferengine.bench.gpu_trace import DEFAULT_INTERVAL_S, GpuTrace
from inferengine.bench.runner import jsonable, run_serve, save_result
from inferengine.bench.systems import (
    ServerProcess,
    SystemSpec,
    bind_port,
    trim_log,
    wait_until_healthy,
)
from inferengine.bench.vllm_client import VLLM_PYTHONPATH, vllm_bench_command
from inferengine.errors import ConfigError, InferEngineError

RESULTS_ROOT = Path("benchmarks/results")


@dataclass
class PairedConfig:
    systems: list[SystemSpec]
    workload: WorkloadConfig
    tokenizer: str
    model: str | None = None  # the `model` to send to every system; None: ask each server
    out_dir: Path | None = None
    name: str = "paired"
    gates: list[Gate] = field(default_factory=list)
    health_timeout_s: float = 900.0
    stop_timeout_s: float = 30.0
    gpu_interval_s: float = DEFAULT_INTERVAL_S
    log_lines: int = 2000
    vllm_client: bool = False
    vllm_python: str = "python3"
    vllm_pythonpath: str = VLLM_PYTHONPATH
    vllm_client_timeout_s: float = 3600.0
    disable_tqdm: bool = False
    command_line: str = ""


def default_out_dir(name: str) -> Path:
    """`benchmarks/results/<UTC stamp>-<name>` under the working directory (the checkout)."""
    return RESULTS_ROOT / f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}-{name}"


def system_workload(workload: WorkloadConfig, spec: SystemSpec) -> WorkloadConfig:
    """The workload as this server must receive it (same lengths; request fields it accepts)."""
    return dataclasses.replace(
        workload,
        ignore_eos=workload.ignore_eos and spec.send_ignore_eos,
        extra_body={**workload.extra_body, **spec.extra_body},
    )


def run_paired(cfg: PairedConfig) -> int:
    """Run every system, write the folder; 0 when all ran and every gate passed, else 1."""
    names = [s.name for s in cfg.systems]
    if not names or len(set(names)) != len(names):
        raise ConfigError("give each --system a different NAME")
    out = cfg.out_dir or default_out_dir(cfg.name)
    out.mkdir(parents=True, exist_ok=True)
    print(f"Results go to {out}")
    requests = sample_requests(cfg.workload.dataset, load_tokenizer(cfg.tokenizer))
    bandwidth = copy_bandwidth_gbps()  # before any server holds the GPU

    runs: dict[str, dict] = {}
    results: dict[str, dict | None] = {}
    for spec in cfg.systems:
        runs[spec.name], results[spec.name] = run_system(spec, cfg, requests, out)

    values = collect_values(
        names,
        results,
        {n: runs[n]["ready_s"] for n in names},
        extra_metrics=[g.metric for g in cfg.gates],
    )
    comparison = build_comparison(names, values, cfg.gates)
    comparison["all_systems_ran"] = all(runs[n]["error"] is None for n in names)
    comparison["passed"] = comparison["gates_passed"] and comparison["all_systems_ran"]
    comparison["runs"] = runs
    comparison["workload"] = jsonable(dataclasses.asdict(cfg.workload))
    comparison["device_copy_bandwidth_gbps"] = bandwidth
    if cfg.vllm_client:
        comparison["client_agreement"] = {
            n: client_agreement(results[n], _load_json(out, runs[n].get("vllm_client", {})))
            for n in names
        }
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2), encoding="utf-8")

    commands = {"paired": cfg.command_line}
    for n in names:
        commands[f"{n} server"] = (
            runs[n]["command"] or f"(already running at {runs[n]['base_url']})"
        )
        if "vllm_client" in runs[n]:
            commands[f"{n} vllm client"] = runs[n]["vllm_client"]["command"]
    (out / "environment.txt").write_text(environment_text(commands), encoding="utf-8")

    print(format_comparison(comparison))
    for n in names:
        if runs[n]["error"]:
            print(f"{n} did not run: {runs[n]['error']}")
    print(f"Wrote {out}")
    return 0 if comparison["passed"] else 1


def run_system(
    spec: SystemSpec, cfg: PairedConfig, requests: Sequence[SampleRequest], out: Path
) -> tuple[dict, dict | None]:
    """Launch (or reach), wait, benchmark, stop one system; returns its record and result."""
    command, base_url = bind_port(spec)
    workload = system_workload(cfg.workload, spec)
    log_path = out / f"{spec.name}.log"
    record: dict = {
        "preset": spec.preset,
        "command": command,
        "base_url": base_url,
        "ready_s": None,
        "result_file": None,
        "log_file": log_path.name,
        "gpu_trace_file": f"{spec.name}-gpu.csv",
        "ignore_eos_sent": workload.ignore_eos,
        "extra_body": workload.extra_body,
        "error": None,
    }
    result = None
    server = None
    trace = GpuTrace(cfg.gpu_interval_s)
    trace.start()
    try:
        if command:
            print(f"[{spec.name}] starting: {command}")
            server = ServerProcess(command, log_path)
        else:
            log_path.write_text(f"# {spec.name} was already running at {base_url}\n")
        ready_s = wait_until_healthy(base_url, cfg.health_timeout_s, server)
        if server is not None:
            record["ready_s"] = ready_s
            print(f"[{spec.name}] ready after {ready_s:.1f} s")
        trace.set_phase("benchmark")
        serve_cfg = ServeConfig(
            workload=workload,
            base_url=base_url,
            model=spec.model or cfg.model,
            tokenizer=cfg.tokenizer,
            label=spec.name,
            disable_tqdm=cfg.disable_tqdm,
        )
        result = run_serve(serve_cfg, requests)
        result["ready_s"] = record["ready_s"]
        save_result(result, out / f"{spec.name}.json")
        record["result_file"] = f"{spec.name}.json"
        if cfg.vllm_client:
            trace.set_phase("vllm-client")
            record["vllm_client"] = run_vllm_client(
                spec.name, cfg, workload, base_url, result["model_id"], out
            )
    except (InferEngineError, OSError, subprocess.SubprocessError) as e:
        record["error"] = f"{type(e).__name__}: {e}"
        print(f"[{spec.name}] failed: {record['error']}")
    finally:
        trace.set_phase("shutdown")
        if server is not None:
            server.stop(cfg.stop_timeout_s)
            trim_log(log_path, cfg.log_lines)
        trace.stop()
        trace.write_csv(out / record["gpu_trace_file"])
        record["gpu"] = trace.summary()
    return record, result


def run_vllm_client(
    name: str, cfg: PairedConfig, workload: WorkloadConfig, base_url: str, model: str, out: Path
) -> dict:
    """vLLM's `bench serve` with the same workload; its JSON is `<system>-vllm.json`."""
    result_file = out / f"{name}-vllm.json"
    argv = vllm_bench_command(
        workload,
        base_url,
        model,
        cfg.tokenizer,
        result_file,
        label=f"{name}-vllm-client",
        python=cfg.vllm_python,
        pythonpath=cfg.vllm_pythonpath,
    )
    log = out / f"{name}-vllm-client.log"
    record = {"command": shlex.join(argv), "log_file": log.name, "returncode": None, "error": None}
    print(f"[{name}] vLLM client: {record['command']}")
    try:
        with open(log, "wb") as f:
            proc = subprocess.run(
                argv, stdout=f, stderr=subprocess.STDOUT, timeout=cfg.vllm_client_timeout_s
            )
        record["returncode"] = proc.returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        record["error"] = f"{type(e).__name__}: {e}"
    trim_log(log, cfg.log_lines)
    record["result_file"] = result_file.name if result_file.exists() else None
    return record


def client_agreement(ours: dict | None, vllm: dict | None) -> dict:
    """Per headline metric, our client's value over vLLM's client's, on the same server."""
    if not ours or not vllm:
        return {"error": "a result is missing"}
    rows = {}
    for metric in HEADLINE_METRICS:
        a, b = metric_value(ours, metric), metric_value(vllm, metric)
        if a is not None and b is not None:
            rows[metric] = {"ours": a, "vllm": b, "ratio": ratio(a, b)}
    deviations = [abs(r["ratio"] - 1) for r in rows.values() if r["ratio"] is not None]
    return {"metrics": rows, "max_abs_deviation": max(deviations, default=None)}


def _load_json(out: Path, record: dict) -> dict | None:
    name = record.get("result_file")
    if not name:
        return None
    try:
        return json.loads((out / name).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
