"""`bench paired`: the same workloads against several servers, repeated in alternating order.

A run is `repeats` rounds. Round k launches the systems in turn, the order rotated by k (A B,
then B A, ...), so that neither always goes first on a cold or a warm GPU. Each launch waits for
/health (the ready time), gets the same launch warm-up, then runs every workload through the
judge — `vllm bench serve` when vLLM is there, else our `bench serve` — with the workload's
warm-up requests first, the same for every system (`paired_launch.py` says what runs around a
measured window: nothing of ours during it). `--alone vllm` adds a system that is vLLM started
and judged exactly as a user would (`vllm serve`, then `vllm bench serve`, nothing else on the
host), in the same rotation, so the harness's vLLM figure stands next to vLLM alone. The GPU's
copy bandwidth and bf16 matmul peak are measured once, in a child process, before any server
starts. The folder keeps, within a size budget:

    summary.json                 every run's judge numbers, their median and range per system,
                                 ratios of medians, vLLM alone beside the harness's vLLM, the
                                 decode bandwidth floor, the prefill MFU, gates, and the mode
                                 each figure came from (paired, alone; traced with --gpu-trace)
    runs/<workload>/r<k>-<system>[-ours].json   each client result without per-request arrays
    logs/r<k>-<system>.log       the server's log, head and tail
    environment.txt              GPU, driver, versions, revision and every command line
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

from inferengine.bench.config import WorkloadConfig
from inferengine.bench.datasets import SampleRequest, load_tokenizer, sample_requests
from inferengine.bench.environment import environment_text, git_revision, vllm_version
from inferengine.bench.floor import batch1_floor, fp8_formats, server_flag
from inferengine.bench.gpu_trace import describe_gpus
from inferengine.bench.host import probe_device
from inferengine.bench.mfu import prefill_mfu
from inferengine.bench.paired_launch import LAUNCH_WARMUP, PairedConfig, run_launch
from inferengine.bench.runner import jsonable
from inferengine.bench.summary import format_summary, spread, workload_summary
from inferengine.bench.systems import SystemSpec
from inferengine.bench.vllm_client import VLLM_PYTHONPATH
from inferengine.errors import ConfigError

RESULTS_ROOT = Path("benchmarks/results")
SUMMARY_FORMAT = "inferengine-bench-paired/3"
JUDGES = ("vllm", "ours")
MODES = {
    "paired": "launched by the harness in the rotation; nothing else ran in the judge's window",
    "alone": "vLLM as a user runs it: `vllm serve`, then `vllm bench serve`, nothing else",
    "traced": "an NVML sampler ran beside the judge (--gpu-trace): not for comparison",
}
COMPARED_TO_ALONE = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms")


def default_out_dir(name: str) -> Path:
    """`benchmarks/results/<UTC stamp>-<name>` under the working directory (the checkout)."""
    return RESULTS_ROOT / f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}-{name}"


def vllm_available(pythonpath: str = VLLM_PYTHONPATH) -> bool:
    return Path(pythonpath, "vllm").is_dir()


def round_order(systems: Sequence[SystemSpec], k: int) -> list[SystemSpec]:
    """Round k's launch order: the systems rotated left by k."""
    shift = k % len(systems)
    return [*systems[shift:], *systems[:shift]]


def launched_systems(cfg: PairedConfig) -> list[SystemSpec]:
    """The systems of a round: each --system in its mode, then each --alone one again as
    NAME-alone (the same command, judged as a user would)."""
    mode = "traced" if cfg.gpu_trace else "paired"
    systems = [dataclasses.replace(s, mode=mode) for s in cfg.systems]
    by_name = {s.name: s for s in cfg.systems}
    alone = [dataclasses.replace(by_name[n], name=f"{n}-alone", mode="alone") for n in cfg.alone]
    return systems + alone


def check_config(cfg: PairedConfig) -> None:
    names = [s.name for s in cfg.systems]
    if not names or len(set(names)) != len(names):
        raise ConfigError("give each --system a different NAME")
    for name in cfg.alone:
        spec = next((s for s in cfg.systems if s.name == name), None)
        if spec is None or spec.command is None:
            raise ConfigError(
                f"--alone {name}: name a --system that the harness starts (a command or preset)"
            )
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
        named = [*cfg.workloads, LAUNCH_WARMUP]
        prompts = {w.name: sample_requests(w.workload.dataset, tokenizer) for w in named}
    device = probe_device()  # before any server holds the GPU, in a child process
    print(f"device: {device}")

    launches: list[dict] = []
    runs: list[dict] = []
    rounds = range(cfg.start_repeat, cfg.start_repeat + cfg.repeats)
    for k in rounds:
        for position, spec in enumerate(round_order(launched_systems(cfg), k)):
            launch, launch_runs = run_launch(spec, k, position, cfg, prompts, out)
            launches.append(launch)
            runs += launch_runs

    summary = build_summary(cfg, launches, runs, device, list(rounds))
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


def build_summary(
    cfg: PairedConfig,
    launches: Sequence[Mapping],
    runs: Sequence[Mapping],
    device: Mapping,
    rounds: Sequence[int],
) -> dict:
    systems = [s.name for s in cfg.systems]
    launched = launched_systems(cfg)
    alone = [s.name for s in launched if s.mode == "alone"]
    ready = {
        name: {
            **spread([x["ready_s"] for x in launches if x["system"] == name]),
            "runs": [x["ready_s"] for x in launches if x["system"] == name],
        }
        for name in [*systems, *alone]
    }
    workloads = {}
    for named in cfg.workloads:
        mine = [r for r in runs if r["workload"] == named.name]
        entry = {
            "description": named.description,
            "config": dataclasses.asdict(named.workload),
            **workload_summary(systems, mine, ready, cfg.gates, named.name),
        }
        if alone:
            entry |= alone_entry(cfg, [r for r in mine if r["system"] in alone], entry)
        if named.workload.max_concurrency == 1:
            entry["floor"] = floor_entry(cfg, named.workload, entry, device.get("copy_gbps"))
        if named.workload.dataset.random_output_len == 1:
            entry["mfu"] = mfu_entry(cfg, entry, device.get("bf16_matmul_tflops"))
        workloads[named.name] = entry
    errors = [f"r{x['repeat']} {x['system']}: {x['error']}" for x in launches if x["error"]]
    errors += [
        f"r{r['repeat']} {r['system']} {r['workload']}: {r['error']}"
        for r in runs
        if r.get("error")
    ]
    expected = len(rounds) * len(launched) * len(cfg.workloads)
    if len(runs) < expected:
        errors.append(f"{expected - len(runs)} of {expected} runs did not happen")
    gates_passed = all(v["passed"] for w in workloads.values() for v in w["gates"])
    judge = "vllm bench serve" if cfg.judge == "vllm" else "inferengine bench serve"
    return {
        "format": SUMMARY_FORMAT,
        "name": cfg.name,
        "systems": systems,
        "alone_systems": alone,
        "modes": {s.name: s.mode for s in launched},
        "mode_meanings": MODES,
        "judge": judge,
        "judge_version": vllm_version() if cfg.judge == "vllm" else None,
        "our_client_after_judge": cfg.our_client and cfg.judge == "vllm",
        "launch_warmup": LAUNCH_WARMUP.description if cfg.launch_warmup else None,
        "gpu_trace": cfg.gpu_trace,
        "revision": cfg.revision or git_revision(),
        "gpu": describe_gpus()[0],
        "model_dir": cfg.model_dir,
        "rounds": {k: [s.name for s in round_order(launched, k)] for k in rounds},
        "runs_per_system": len(rounds),
        "device": dict(device),
        "device_copy_bandwidth_gbps": device.get("copy_gbps"),
        "ready_s": ready,
        "workloads": workloads,
        "launches": list(launches),
        "errors": errors,
        "gates_passed": gates_passed,
        "passed": gates_passed and not errors,
    }


def alone_entry(cfg: PairedConfig, runs: Sequence[Mapping], entry: Mapping) -> dict:
    """Each alone system's runs and spreads, and the harness's figure of the same system over
    it (`harness_vs_alone`: its median in the paired rotation / its median alone)."""
    by_name: dict[str, dict] = {}
    versus: dict[str, dict] = {}
    for of in cfg.alone:
        name = f"{of}-alone"
        mine = [r for r in runs if r["system"] == name]
        spreads = {m: spread([r["metrics"].get(m) for r in mine]) for m in COMPARED_TO_ALONE}
        by_name[name] = {"runs": mine, "spread": spreads}
        paired = entry["systems"][of]["spread"]
        versus[of] = {
            m: _ratio(paired.get(m, {}).get("median"), spreads[m]["median"])
            for m in COMPARED_TO_ALONE
        }
    return {"alone": by_name, "harness_vs_alone": versus}


def mfu_entry(cfg: PairedConfig, entry: Mapping, peak_tflops: float | None) -> dict:
    """Per system of a prefill-only workload: each run's MFU (model FLOPs over the peak of all
    its tensor-parallel GPUs) and their median."""
    try:
        config = json.loads(Path(str(cfg.model_dir), "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return {"reason": f"no model config: {e}"}
    out: dict = {"peak_bf16_matmul_tflops_per_gpu": peak_tflops}
    for spec in cfg.systems:
        gpus = tensor_parallel_size(spec.command)
        peak = peak_tflops * gpus if peak_tflops else None
        try:
            per_run = [
                prefill_mfu(config, r["metrics"], peak) for r in entry["systems"][spec.name]["runs"]
            ]
        except (KeyError, ValueError) as e:
            return {"reason": f"{type(e).__name__}: {e}"}
        out[spec.name] = {
            "gpus": gpus,
            "runs": per_run,
            "mfu_pct": spread([m.get("mfu_pct") for m in per_run]),
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


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
