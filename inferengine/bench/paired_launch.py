"""One launch of a paired run: start (or reach) a system, warm it up, judge every workload, stop it.

While the judge measures, nothing else of ours runs on the host: the harness waits on the
judge's process, no sampler or poller is started (the NVML trace only with `--gpu-trace`, for a
separate run whose figures are marked traced), /metrics is read once before and once after a
window, and our client, when asked for, runs after the judge, never beside it. Each launch
gets the same launch warm-up (`LAUNCH_WARMUP` through the judge, not recorded) and each
workload its own warm-up requests. A system in `alone` mode (vLLM as a user runs it: `vllm
serve`, then `vllm bench serve`) gets no /metrics read and no our client either.
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
from pathlib import Path

from inferengine.bench.compact import compact_result, trim_log
from inferengine.bench.config import DatasetConfig, ServeConfig, WorkloadConfig
from inferengine.bench.datasets import SampleRequest
from inferengine.bench.gates import Gate
from inferengine.bench.gpu_trace import DEFAULT_INTERVAL_S, GpuTrace
from inferengine.bench.host import child_env, gpu_processes
from inferengine.bench.runner import fetch_first_model, jsonable, new_session, run_serve
from inferengine.bench.spec_counters import output_lens_digest, scrape_spec_counters, spec_delta
from inferengine.bench.summary import run_metrics
from inferengine.bench.systems import ServerProcess, SystemSpec, bind_port, wait_until_healthy
from inferengine.bench.vllm_client import VLLM_PYTHONPATH, vllm_bench_command
from inferengine.bench.workloads import NamedWorkload
from inferengine.errors import InferEngineError

SERVER_STATS = r"throughput|Running:|KV cache usage|preempt|speculation:|warm-up:"  # log lines kept
# Short requests after /health, the same for every system, before its first workload: the
# prompts of no workload (their own seed), so they leave nothing in the prefix cache to hit.
LAUNCH_WARMUP = NamedWorkload(
    "launch-warmup",
    "48 prompts, in 256, out 64, concurrency 16, before the first workload of a launch",
    WorkloadConfig(
        dataset=DatasetConfig(
            num_prompts=48, seed=4242, random_input_len=256, random_output_len=64
        ),
        max_concurrency=16,
        ignore_eos=True,
        temperature=0.0,
    ),
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
    alone: list[str] = field(default_factory=list)  # systems to measure alone as well
    launch_warmup: bool = True  # LAUNCH_WARMUP through the judge after each /health
    gpu_trace: bool = False  # sample NVML beside the judge (a separate, non-judged run)
    health_timeout_s: float = 900.0
    stop_timeout_s: float = 30.0
    gpu_interval_s: float = DEFAULT_INTERVAL_S
    vllm_python: str = "python3"
    vllm_pythonpath: str = VLLM_PYTHONPATH
    client_timeout_s: float = 3600.0
    disable_tqdm: bool = False
    command_line: str = ""
    revision: str | None = None  # what was measured; default: git here


def system_workload(workload: WorkloadConfig, spec: SystemSpec) -> WorkloadConfig:
    """The workload as this server must receive it (same lengths; request fields it accepts)."""
    return dataclasses.replace(
        workload,
        ignore_eos=workload.ignore_eos and spec.send_ignore_eos,
        extra_body={**workload.extra_body, **spec.extra_body},
    )


def run_launch(
    spec: SystemSpec,
    k: int,
    position: int,
    cfg: PairedConfig,
    prompts: Mapping[str, Sequence[SampleRequest]],
    out: Path,
) -> tuple[dict, list[dict]]:
    """Launch (or reach) one system, warm it up, run every workload on it, stop it."""
    command, base_url = bind_port(spec)
    log_path = out / "logs" / f"r{k}-{spec.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    launch: dict = {
        "repeat": k,
        "position": position,
        "system": spec.name,
        "mode": spec.mode,
        "preset": spec.preset,
        "command": command,
        "base_url": base_url,
        "ready_s": None,
        "log_file": str(log_path.relative_to(out)),
        "gpu_processes_before": gpu_processes(),
        "error": None,
    }
    runs: list[dict] = []
    server = None
    trace = GpuTrace(cfg.gpu_interval_s) if cfg.gpu_trace else None
    if trace is not None:
        trace.start()
    try:
        if command:
            print(f"[r{k} {spec.name}] starting: {command}")
            server = ServerProcess(command, log_path, child_env(vllm=spec.preset == "vllm"))
        else:
            log_path.write_text(f"# {spec.name} was already running at {base_url}\n")
        ready_s = wait_until_healthy(base_url, cfg.health_timeout_s, server)
        if server is not None:
            launch["ready_s"] = ready_s
            print(f"[r{k} {spec.name}] ready after {ready_s:.1f} s")
        model = spec.model or cfg.model or served_model(base_url)
        if cfg.launch_warmup:
            launch["warmup"] = launch_warmup(spec, k, base_url, model, cfg, prompts, out)
        for named in cfg.workloads:
            if trace is not None:
                trace.set_phase(named.name)
            run = run_workload(spec, named, k, position, base_url, model, cfg, prompts, out)
            if trace is not None:
                run["metrics"]["busy_pct"] = _busy(trace, run.pop("_window", None))
            run.pop("_window", None)
            runs.append(run)
    except (InferEngineError, OSError, subprocess.SubprocessError) as e:
        launch["error"] = f"{type(e).__name__}: {e}"
        print(f"[r{k} {spec.name}] failed: {launch['error']}")
    finally:
        if trace is not None:
            trace.set_phase("shutdown")
        if server is not None:
            server.stop(cfg.stop_timeout_s)
            launch["killed_after_sigterm"] = server.killed
            trim_log(log_path, keep=SERVER_STATS)
        launch["gpu"] = {"traced": trace is not None}
        if trace is not None:
            trace.stop()
            launch["gpu"] |= {"available": trace.unavailable is None, "phases": trace.phases()}
            if trace.unavailable:
                launch["gpu"]["unavailable_reason"] = trace.unavailable
    return launch, runs


def _busy(trace: GpuTrace, window: tuple[float, float] | None) -> float | None:
    return trace.busy_between(*window) if window else None


def launch_warmup(
    spec: SystemSpec,
    k: int,
    base_url: str,
    model: str | None,
    cfg: PairedConfig,
    prompts: Mapping[str, Sequence[SampleRequest]],
    out: Path,
) -> dict:
    """`LAUNCH_WARMUP` through the judge; only its command and outcome are kept."""
    workload = system_workload(LAUNCH_WARMUP.workload, spec)
    folder = out / "runs" / LAUNCH_WARMUP.name
    folder.mkdir(parents=True, exist_ok=True)
    result_file = folder / f"r{k}-{spec.name}.json"
    if cfg.judge == "vllm":
        result, record = run_vllm_judge(cfg, workload, base_url, model, result_file)
    else:
        requests = prompts[LAUNCH_WARMUP.name]
        result, record = run_our_client(cfg, workload, base_url, model, requests, "warmup"), {}
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    record["completed"] = (result or {}).get("completed")
    return record


def run_workload(
    spec: SystemSpec,
    named: NamedWorkload,
    k: int,
    position: int,
    base_url: str,
    model: str | None,
    cfg: PairedConfig,
    prompts: Mapping[str, Sequence[SampleRequest]],
    out: Path,
) -> dict:
    """The judge (then maybe our client) on one workload; the judge's numbers are the run's.
    `_window` is the judge's measured window in wall-clock seconds (for a GPU trace)."""
    workload = system_workload(named.workload, spec)
    folder = out / "runs" / named.name
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"r{k}-{spec.name}"
    run: dict = {
        "repeat": k,
        "position": position,
        "system": spec.name,
        "mode": spec.mode,
        "workload": named.name,
    }
    user_only = spec.mode == "alone"
    counters = None if user_only else scrape_spec_counters(base_url)
    if cfg.judge == "vllm":
        result, record = run_vllm_judge(cfg, workload, base_url, model, folder / f"{stem}.json")
        run |= record
        # The judge writes its JSON as its measured window closes.
        ended = (folder / f"{stem}.json").stat().st_mtime if result else None
    else:
        result = run_our_client(cfg, workload, base_url, model, prompts[named.name], spec.name)
        ended = time.time()
        _save(result, folder / f"{stem}.json")
    run["result_file"] = str((folder / f"{stem}.json").relative_to(out)) if result else None
    if not user_only:
        run["speculation"] = spec_delta(counters, scrape_spec_counters(base_url))
    run["output_lens_digest"] = output_lens_digest((result or {}).get("output_lens"))
    run["metrics"] = run_metrics(result)
    duration = run["metrics"].get("duration")
    run["metrics"]["busy_pct"] = None  # measured only in a traced run
    run["_window"] = (ended - duration, ended) if ended and duration else None
    if result is None:
        run.setdefault("error", "the judge wrote no result")
    elif run["metrics"].get("failed"):
        run.setdefault("error", f"{run['metrics']['failed']:.0f} requests failed")
    if cfg.our_client and cfg.judge == "vllm" and not user_only:
        ours = run_our_client(cfg, workload, base_url, model, prompts[named.name], spec.name)
        _save(ours, folder / f"{stem}-ours.json")
        run["our_client"] = run_metrics(ours)
    print(
        f"[r{k} {spec.name}] {named.name}: "
        f"{run['metrics'].get('output_throughput') or 0:.1f} tok/s, "
        f"median TTFT {run['metrics'].get('median_ttft_ms') or 0:.1f} ms, "
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
    """vLLM's `bench serve` on the workload, in the environment a user's shell would give it;
    its summary JSON, compacted, is `result_file`."""
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
                argv,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=cfg.client_timeout_s,
                env=child_env(vllm=True),
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
