"""`bench paired`: the same workloads against several servers, repeated in alternating order.

A run is `repeats` rounds. Round k launches the systems in turn, the order rotated by k (A B,
then B A, ...), so that neither always goes first on a cold or a warm GPU. Each launch waits for
/health (the ready time), then runs every workload through the judge — `vllm bench serve` when
vLLM is there, else our `bench serve` — with the workload's warm-up requests first, the same for
every system; our client may run beside the judge. NVML samples the GPU throughout; each run
gets the share of its measured window (the judge's `duration`) in which the GPU was busy. The
folder keeps, within a size budget:

    summary.json                 every run's judge numbers, their median and range per system,
                                 ratios of medians, the decode bandwidth floor, gates
    runs/<workload>/r<k>-<system>[-ours].json   each client result without per-request arrays
    logs/r<k>-<system>.log       the server's log, head and tail
    environment.txt              GPU, driver, versions, revision and every command line
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from inferengine.bench.bandwidth import copy_bandwidth_gbps
from inferengine.bench.compact import compact_result, trim_log
from inferengine.bench.config import ServeConfig, WorkloadConfig
from inferengine.bench.datasets import SampleRequest, load_tokenizer, sample_requests
from inferengine.bench.environment import environment_text, git_revision, vllm_version
from inferengine.bench.floor import batch1_floor, fp8_formats, server_flag
from inferengine.bench.gates import Gate
from inferengine.bench.gpu_trace import DEFAULT_INTERVAL_S, GpuTrace, describe_gpus
from inferengine.bench.runner import fetch_first_model, jsonable, new_session, run_serve
from inferengine.bench.spec_counters import output_lens_digest, scrape_spec_counters, spec_delta
from inferengine.bench.summary import format_summary, run_metrics, spread, workload_summary
from inferengine.bench.systems import ServerProcess, SystemSpec, bind_port, wait_until_healthy
from inferengine.bench.vllm_client import VLLM_PYTHONPATH, vllm_bench_command
from inferengine.bench.workloads import NamedWorkload
from inferengine.errors import ConfigError, InferEngineError

RESULTS_ROOT = Path("benchmarks/results")
SUMMARY_FORMAT = "inferengine-bench-paired/2"
JUDGES = ("vllm", "ours")
SERVER_STATS = (
    r"throughput|Running:|KV cache usage|preempt|speculation:"  # log lines kept from the middle
)


@dataclass
class PairedConfig:
    systems: list[SystemSpec]
    workloads: list[NamedWorkload]
    tokenizer: str
    model: str | None = None  # the `model` to send to every system; None: ask each server
    model_dir: str | None = None  # for the bandwidth floor
    out_dir: Path | None = None
    name: str = "paired"
    gates: list[Gate] = field(default_factory=list)
    repeats: int = 3
    start_repeat: int = 0  # a later call's first round, so that the order keeps alternating
    judge: str = "vllm"
    our_client: bool = False  # also run our client after the judge
    health_timeout_s: float = 900.0
    stop_timeout_s: float = 30.0
    gpu_interval_s: float = DEFAULT_INTERVAL_S
    vllm_python: str = "python3"
    vllm_pythonpath: str = VLLM_PYTHONPATH
    client_timeout_s: float = 3600.0
    disable_tqdm: bool = False
    command_line: str = ""
    revision: str | None = None  # what was measured; default: git here


def default_out_dir(name: str) -> Path:
    """`benchmarks/results/<UTC stamp>-<name>` under the working directory (the checkout)."""
    return RESULTS_ROOT / f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}-{name}"


def vllm_available(pythonpath: str = VLLM_PYTHONPATH) -> bool:
    return Path(pythonpath, "vllm").is_dir()


def round_order(systems: Sequence[SystemSpec], k: int) -> list[SystemSpec]:
    """Round k's launch order: the systems rotated left by k."""
    shift = k % len(systems)
    return [*systems[shift:], *systems[:shift]]


def system_workload(workload: WorkloadConfig, spec: SystemSpec) -> WorkloadConfig:
    """The workload as this server must receive it (same lengths; request fields it accepts)."""
    return dataclasses.replace(
        workload,
        ignore_eos=workload.ignore_eos and spec.send_ignore_eos,
        extra_body={**workload.extra_body, **spec.extra_body},
    )


def check_config(cfg: PairedConfig) -> None:
    names = [s.name for s in cfg.systems]
    if not names or len(set(names)) != len(names):
        raise ConfigError("give each --system a different NAME")
    if cfg.repeats < 1 or cfg.start_repeat < 0:
        raise ConfigError("--repeats must be at least 1 and --start-repeat at least 0")
    if cfg.judge not in JUDGES:
        raise ConfigError(f"--judge must be one of {', '.join(JUDGES)} (or auto)")
    if cfg.judge == "vllm" and not vllm_available(cfg.vllm_pythonpath):
        raise ConfigError(
            f"the judge is vLLM's `bench serve`, but {cfg.vllm_pythonpath} has no vllm; unpack "
            "it there (--vllm-pythonpath) or pass --judge ours"
        )
    workload_names = [w.name for w in cfg.workloads]
    if not workload_names or len(set(workload_names)) != len(workload_names):
        raise ConfigError("give each workload once")
    for gate in cfg.gates:
        if gate.workload is not None and gate.workload not in workload_names:
            raise ConfigError(
                f"gate {gate.expr!r} names workload {gate.workload!r}, which this run does not "
                f"have ({', '.join(workload_names)})"
            )


def run_paired(cfg: PairedConfig) -> int:
    """Run every round, write the folder; 0 when every run worked and every gate passed."""
    check_config(cfg)
    out = cfg.out_dir or default_out_dir(cfg.name)
    out.mkdir(parents=True, exist_ok=True)
    print(f"Results go to {out}")
    prompts: dict[str, list[SampleRequest]] = {}
    if cfg.judge == "ours" or cfg.our_client:
        tokenizer = load_tokenizer(cfg.tokenizer)
        prompts = {w.name: sample_requests(w.workload.dataset, tokenizer) for w in cfg.workloads}
    bandwidth = copy_bandwidth_gbps()  # before any server holds the GPU

    launches: list[dict] = []
    runs: list[dict] = []
    rounds = range(cfg.start_repeat, cfg.start_repeat + cfg.repeats)
    for k in rounds:
        for position, spec in enumerate(round_order(cfg.systems, k)):
            launch, launch_runs = run_launch(spec, k, position, cfg, prompts, out)
            launches.append(launch)
            runs += launch_runs

    summary = build_summary(cfg, launches, runs, bandwidth, list(rounds))
    (out / "summary.json").write_text(json.dumps(jsonable(summary), indent=1), encoding="utf-8")
    commands = {"paired": cfg.command_line}
    for launch in launches:
        commands[f"r{launch['repeat']} {launch['system']} server"] = launch["command"] or (
            f"(already running at {launch['base_url']})"
        )
    for run in runs:
        if run.get("judge_command"):
            commands[f"r{run['repeat']} {run['system']} {run['workload']} judge"] = run[
                "judge_command"
            ]
    (out / "environment.txt").write_text(environment_text(commands, cfg.revision), encoding="utf-8")
    print(format_summary(summary))
    try:
        from inferengine.bench.plot import plot_results

        plot_results(out)
    except ImportError as e:  # matplotlib is a dev extra
        print(f"no plot: {e}")
    for error in summary["errors"]:
        print(f"error: {error}")
    print(f"Wrote {out}")
    return 0 if summary["passed"] else 1


def run_launch(
    spec: SystemSpec,
    k: int,
    position: int,
    cfg: PairedConfig,
    prompts: Mapping[str, Sequence[SampleRequest]],
    out: Path,
) -> tuple[dict, list[dict]]:
    """Launch (or reach) one system, run every workload on it, stop it."""
    command, base_url = bind_port(spec)
    log_path = out / "logs" / f"r{k}-{spec.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    launch: dict = {
        "repeat": k,
        "position": position,
        "system": spec.name,
        "preset": spec.preset,
        "command": command,
        "base_url": base_url,
        "ready_s": None,
        "log_file": str(log_path.relative_to(out)),
        "error": None,
    }
    runs: list[dict] = []
    server = None
    trace = GpuTrace(cfg.gpu_interval_s)
    trace.start()
    try:
        if command:
            print(f"[r{k} {spec.name}] starting: {command}")
            server = ServerProcess(command, log_path)
        else:
            log_path.write_text(f"# {spec.name} was already running at {base_url}\n")
        ready_s = wait_until_healthy(base_url, cfg.health_timeout_s, server)
        if server is not None:
            launch["ready_s"] = ready_s
            print(f"[r{k} {spec.name}] ready after {ready_s:.1f} s")
        for named in cfg.workloads:
            trace.set_phase(named.name)
            runs.append(run_workload(spec, named, k, position, base_url, cfg, prompts, out, trace))
    except (InferEngineError, OSError, subprocess.SubprocessError) as e:
        launch["error"] = f"{type(e).__name__}: {e}"
        print(f"[r{k} {spec.name}] failed: {launch['error']}")
    finally:
        trace.set_phase("shutdown")
        if server is not None:
            server.stop(cfg.stop_timeout_s)
            trim_log(log_path, keep=SERVER_STATS)
        trace.stop()
        launch["gpu"] = {"available": trace.unavailable is None, "phases": trace.phases()}
        if trace.unavailable:
            launch["gpu"]["unavailable_reason"] = trace.unavailable
    return launch, runs


def run_workload(
    spec: SystemSpec,
    named: NamedWorkload,
    k: int,
    position: int,
    base_url: str,
    cfg: PairedConfig,
    prompts: Mapping[str, Sequence[SampleRequest]],
    out: Path,
    trace: GpuTrace,
) -> dict:
    """The judge (and maybe our client) on one workload; the judge's numbers are the run's."""
    workload = system_workload(named.workload, spec)
    folder = out / "runs" / named.name
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"r{k}-{spec.name}"
    run: dict = {"repeat": k, "position": position, "system": spec.name, "workload": named.name}
    model = spec.model or cfg.model or served_model(base_url)
    counters = scrape_spec_counters(base_url)
    if cfg.judge == "vllm":
        result, record = run_vllm_judge(cfg, workload, base_url, model, folder / f"{stem}.json")
        run |= record
        # The judge writes its JSON as its measured window closes; its start-up, the prompt
        # sampling and the warm-up lie before that window and are not counted as idle.
        ended = (folder / f"{stem}.json").stat().st_mtime if result else None
    else:
        result = run_our_client(cfg, workload, base_url, model, prompts[named.name], spec.name)
        ended = time.time()
        _save(result, folder / f"{stem}.json")
    run["result_file"] = str((folder / f"{stem}.json").relative_to(out)) if result else None
    run["speculation"] = spec_delta(counters, scrape_spec_counters(base_url))
    run["output_lens_digest"] = output_lens_digest((result or {}).get("output_lens"))
    run["metrics"] = run_metrics(result)
    duration = run["metrics"].get("duration")
    busy = trace.busy_between(ended - duration, ended) if ended and duration else None
    run["metrics"]["busy_pct"] = busy
    if result is None:
        run.setdefault("error", "the judge wrote no result")
    elif run["metrics"].get("failed"):
        run.setdefault("error", f"{run['metrics']['failed']:.0f} requests failed")
    if cfg.our_client and cfg.judge == "vllm":
        trace.set_phase(f"{named.name}:ours")
        ours = run_our_client(cfg, workload, base_url, model, prompts[named.name], spec.name)
        _save(ours, folder / f"{stem}-ours.json")
        run["our_client"] = run_metrics(ours)
    print(
        f"[r{k} {spec.name}] {named.name}: "
        f"{run['metrics'].get('output_throughput') or 0:.1f} tok/s, "
        f"median ITL {run['metrics'].get('median_itl_ms') or 0:.2f} ms"
    )
    return run


def served_model(base_url: str) -> str:
    """The first model id the server lists, named explicitly to every client: vLLM's client
    asks /tokenize to align its random prompts only when it is given the model's name."""

    async def ask() -> str:
        async with new_session(None) as session:
            return (await fetch_first_model(session, base_url))[0]

    return asyncio.run(ask())


def run_our_client(
    cfg: PairedConfig,
    workload: WorkloadConfig,
    base_url: str,
    model: str | None,
    requests: Sequence[SampleRequest],
    label: str,
) -> dict:
    serve = ServeConfig(
        workload=workload,
        base_url=base_url,
        model=model,
        tokenizer=cfg.tokenizer,
        label=label,
        disable_tqdm=cfg.disable_tqdm,
    )
    return run_serve(serve, requests)


def run_vllm_judge(
    cfg: PairedConfig,
    workload: WorkloadConfig,
    base_url: str,
    model: str | None,
    result_file: Path,
) -> tuple[dict | None, dict]:
    """vLLM's `bench serve` on the workload; its summary JSON, compacted, is `result_file`."""
    argv = vllm_bench_command(
        workload,
        base_url,
        model,
        cfg.tokenizer,
        result_file,
        label=result_file.stem,
        python=cfg.vllm_python,
        pythonpath=cfg.vllm_pythonpath,
    )
    record: dict = {"judge_command": shlex.join(argv)}
    log = result_file.with_suffix(".log")
    try:
        with open(log, "wb") as f:
            proc = subprocess.run(
                argv, stdout=f, stderr=subprocess.STDOUT, timeout=cfg.client_timeout_s
            )
        if proc.returncode != 0:
            record["error"] = f"vllm bench serve exited with {proc.returncode}; see {log.name}"
    except (OSError, subprocess.TimeoutExpired) as e:
        record["error"] = f"{type(e).__name__}: {e}"
    trim_log(log)
    try:
        result = json.loads(result_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None, record
    _save(result, result_file)
    return result, record


def _save(result: dict, path: Path) -> None:
    path.write_text(json.dumps(jsonable(compact_result(result)), indent=1), encoding="utf-8")


def build_summary(
    cfg: PairedConfig,
    launches: Sequence[Mapping],
    runs: Sequence[Mapping],
    bandwidth: float | None,
    rounds: Sequence[int],
) -> dict:
    systems = [s.name for s in cfg.systems]
    ready = {
        name: {
            **spread([x["ready_s"] for x in launches if x["system"] == name]),
            "runs": [x["ready_s"] for x in launches if x["system"] == name],
        }
        for name in systems
    }
    workloads = {}
    for named in cfg.workloads:
        mine = [r for r in runs if r["workload"] == named.name]
        entry = {
            "description": named.description,
            "config": dataclasses.asdict(named.workload),
            **workload_summary(systems, mine, ready, cfg.gates, named.name),
        }
        if named.workload.max_concurrency == 1:
            entry["floor"] = floor_entry(cfg, named.workload, entry, bandwidth)
        workloads[named.name] = entry
    errors = [f"r{x['repeat']} {x['system']}: {x['error']}" for x in launches if x["error"]]
    errors += [
        f"r{r['repeat']} {r['system']} {r['workload']}: {r['error']}"
        for r in runs
        if r.get("error")
    ]
    expected = len(rounds) * len(systems) * len(cfg.workloads)
    if len(runs) < expected:
        errors.append(f"{expected - len(runs)} of {expected} runs did not happen")
    gates_passed = all(v["passed"] for w in workloads.values() for v in w["gates"])
    judge = "vllm bench serve" if cfg.judge == "vllm" else "inferengine bench serve"
    return {
        "format": SUMMARY_FORMAT,
        "name": cfg.name,
        "systems": systems,
        "judge": judge,
        "judge_version": vllm_version() if cfg.judge == "vllm" else None,
        "our_client_beside": cfg.our_client and cfg.judge == "vllm",
        "busy_window": "the judge's measured window (its duration, ending when it wrote its JSON)",
        "revision": cfg.revision or git_revision(),
        "gpu": describe_gpus()[0],
        "model_dir": cfg.model_dir,
        "rounds": {k: [s.name for s in round_order(cfg.systems, k)] for k in rounds},
        "runs_per_system": len(rounds),
        "device_copy_bandwidth_gbps": bandwidth,
        "ready_s": ready,
        "workloads": workloads,
        "launches": list(launches),
        "errors": errors,
        "gates_passed": gates_passed,
        "passed": gates_passed and not errors,
    }


def floor_entry(
    cfg: PairedConfig, workload: WorkloadConfig, entry: Mapping, bandwidth: float | None
) -> dict:
    """The batch-1 floor at this workload's mean context, and each system's median TPOT over it."""
    d = workload.dataset
    sizes = {tensor_parallel_size(spec.command) for spec in cfg.systems}
    if len(sizes) > 1:
        return {"floor_ms": None, "reason": "the systems run different tensor-parallel sizes"}
    formats = {fp8_formats(spec.command, cfg.model_dir) for spec in cfg.systems}
    if len(formats) > 1:
        return {"floor_ms": None, "reason": "the systems store weights or KV in different formats"}
    fp8_weights, fp8_kv = formats.pop() if formats else (False, False)
    floor = batch1_floor(
        cfg.model_dir,
        d.random_prefix_len + d.random_input_len,
        d.random_output_len,
        bandwidth,
        tp=sizes.pop() if sizes else 1,
        fp8_weights=fp8_weights,
        fp8_kv=fp8_kv,
    )
    over = {}
    for name, system in entry["systems"].items():
        tpot = system["spread"].get("median_tpot_ms", {}).get("median")
        over[name] = tpot / floor["floor_ms"] if tpot and floor.get("floor_ms") else None
    return {**floor, "tpot_over_floor": over}


def tensor_parallel_size(command: str | None) -> int:
    """The `--tensor-parallel-size` (or `-tp`) a server command line asks for; 1 without one."""
    value = server_flag(command, ("--tensor-parallel-size", "-tp")) or ""
    return int(value) if value.isdigit() else 1
