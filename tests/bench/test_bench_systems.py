"""System specs and presets, server processes, the GPU trace, and the vLLM client's flags."""

from __future__ import annotations

import math
import os
import shlex
import sys
import time
import types

import pytest

from inferengine.bench import systems
from inferengine.bench.config import DatasetConfig, WorkloadConfig
from inferengine.bench.environment import environment_text
from inferengine.bench.gpu_trace import GpuTrace, describe_gpus
from inferengine.bench.systems import ServerProcess, bind_port, parse_system, trim_log
from inferengine.bench.vllm_client import vllm_bench_command, vllm_bench_flags
from inferengine.errors import ConfigError

# Every flag of vLLM 0.26's `bench serve` that the mapping may use (from its argparse setup).
VLLM_FLAGS = {
    "--backend", "--base-url", "--endpoint", "--model", "--tokenizer", "--dataset-name",
    "--dataset-path", "--num-prompts", "--seed", "--random-input-len", "--random-output-len",
    "--random-range-ratio", "--random-prefix-len", "--sharegpt-output-len",
    "--prefix-repetition-prefix-len", "--prefix-repetition-suffix-len",
    "--prefix-repetition-num-prefixes", "--prefix-repetition-output-len", "--request-rate",
    "--burstiness", "--max-concurrency", "--num-warmups", "--temperature", "--ignore-eos",
    "--extra-body", "--goodput", "--percentile-metrics", "--metric-percentiles", "--save-result",
    "--save-detailed", "--disable-tqdm", "--result-dir", "--result-filename", "--label",
}  # fmt: skip


def test_system_specs():
    a = parse_system("A=python -m srv --port {port} --x=1", None, "m")
    assert (a.name, a.command, a.base_url) == ("A", "python -m srv --port {port} --x=1", None)
    b = parse_system("vllm=url:http://127.0.0.1:8001/", None, "m")
    assert (b.command, b.base_url) == (None, "http://127.0.0.1:8001")
    ours = parse_system("ours=preset:inferengine --load-format dummy", "/models/q 7b", "qwen")
    assert "serve '/models/q 7b'" in ours.command and "--served-model-name qwen" in ours.command
    assert ours.command.endswith("--port {port} --served-model-name qwen --load-format dummy")
    hf = parse_system("transformers", "/models/q", "qwen")
    assert hf.name == "transformers" and "transformers serve /models/q" in hf.command
    assert not hf.send_ignore_eos and hf.extra_body == {"generation_config": '{"eos_token_id": -1}'}
    assert hf.model == "/models/q"
    for bad in ("A=", "bad name=cmd", "A=preset:nope", "inferengine"):  # last: no --model-dir
        with pytest.raises(ConfigError):
            parse_system(bad, None, "m")


def test_preset_extra_args_spanning_lines_stay_one_command():
    # benchmarks/gpu_router.sh wrote its server flags over two lines; the shell then ran the
    # second line as a command of its own (exit 127) and the server never saw those flags.
    spec = parse_system("ours=preset:inferengine --a 1\n        --b 2 --c '{\"x\": 1}'", "/m", "m")
    assert "\n" not in spec.command and spec.command.endswith("--a 1 --b 2 --c '{\"x\": 1}'")
    assert shlex.split(spec.command)[-2:] == ["--c", '{"x": 1}']


def test_vllm_preset_needs_the_unpacked_site(monkeypatch, tmp_path):
    monkeypatch.setattr(systems, "VLLM_PYTHONPATH", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="url:"):
        parse_system("vllm", "/models/q", "qwen")
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    monkeypatch.setattr(systems, "VLLM_PYTHONPATH", str(tmp_path / "site"))
    spec = parse_system("vllm=preset:vllm --max-model-len 2048", "/models/q", "qwen")
    assert (
        f"PYTHONPATH={tmp_path / 'site'} python3 -m vllm.entrypoints.cli.main serve" in spec.command
    )
    assert spec.command.endswith("--max-model-len 2048")


def test_ports():
    command, url = bind_port(parse_system("A=srv --port {port}", None, "m"))
    port = int(url.rsplit(":", 1)[1])
    assert command == f"srv --port {port}" and port > 0
    assert bind_port(parse_system("A=srv --port 9001", None, "m"))[1] == "http://127.0.0.1:9001"
    assert bind_port(parse_system("A=srv --port=9002", None, "m"))[1] == "http://127.0.0.1:9002"
    assert bind_port(parse_system("A=srv", None, "m"))[1] == "http://127.0.0.1:8000"


def test_stop_kills_the_whole_group_even_if_sigterm_is_ignored(tmp_path):
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    command = f"sleep 60 & {shlex.quote(sys.executable)} -c {shlex.quote(stubborn)}"
    server = ServerProcess(command, tmp_path / "s.log")
    time.sleep(0.5)
    start = time.perf_counter()
    server.stop(timeout_s=0.5)
    assert time.perf_counter() - start < 5
    assert not systems._session_alive(server.proc.pid, server.proc)
    assert server.killed  # it needed SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(server.proc.pid, 0)  # the leader is gone and reaped


def test_stop_waits_for_a_child_that_left_the_group(tmp_path):
    # Our engine core calls os.setpgrp() and exits a while after the API process: the next
    # system must not start beside it (its CPU and GPU memory still taken).
    core = (
        "import os, signal, sys, time; os.setpgrp(); signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    )
    pid_file = tmp_path / "core.pid"
    command = f"{shlex.quote(sys.executable)} -c {shlex.quote(core)} {pid_file} & sleep 60"
    server = ServerProcess(command, tmp_path / "s.log")
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    core_pid = int(pid_file.read_text())
    assert os.getpgid(core_pid) == core_pid != server.proc.pid  # out of the server's group
    server.stop(timeout_s=0.5)
    assert core_pid in server.killed
    assert systems._session_pids(server.proc.pid) == []  # gone (or a zombie for init to reap)


def test_trim_log(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    trim_log(log, 3)
    assert log.read_text().splitlines() == [
        "# [trimmed: the first 7 of 10 lines dropped]",
        "line 7",
        "line 8",
        "line 9",
    ]


class FakeSampler:
    def read(self):
        return [(0, 50.0, 20.0, 1024.0, 81559.0, 300.0), (1, 0.0, 0.0, 10.0, 81559.0, None)]

    def close(self):
        pass


def test_gpu_trace_samples_on_its_interval(tmp_path):
    trace = GpuTrace(interval_s=0.05, sampler_factory=FakeSampler)
    trace.start()
    time.sleep(0.3)
    trace.set_phase("benchmark")
    time.sleep(0.3)
    trace.stop()
    times = sorted({s.t_s for s in trace.samples})
    assert 5 <= len(times) <= 16  # about 12; fewer if the machine is busy
    assert {s.phase for s in trace.samples} == {"startup", "benchmark"}
    path = tmp_path / "gpu.csv"
    trace.write_csv(path)
    lines = path.read_text().splitlines()
    assert lines[0] == "t_s,phase,gpu,util_pct,mem_util_pct,mem_used_mib,mem_total_mib,power_w"
    assert lines[1].split(",")[1:] == ["startup", "0", "50.0", "20.0", "1024.0", "81559.0", "300.0"]
    assert lines[2].endswith(",")  # no power reading: an empty cell
    summary = trace.summary()
    assert summary["available"] and summary["peak_mem_used_mib"] == 1024.0
    phases = trace.phases()
    assert list(phases) == ["startup", "benchmark"]
    bench = phases["benchmark"]
    assert bench["busy_pct"] == 25.0 and bench["busy_pct_per_gpu"] == {0: 50.0, 1: 0.0}
    assert bench["peak_mem_used_mib"] == 1024.0 and 0.2 <= bench["seconds"] <= 0.6
    t0 = trace.started_at
    assert trace.busy_between(t0, t0 + 10) == 25.0  # both GPUs, every sample
    assert trace.busy_between(t0 + 20, t0 + 30) is None  # no samples in that window


def test_gpu_trace_without_nvml(tmp_path):
    def no_nvml():
        raise ImportError("No module named 'pynvml'")

    trace = GpuTrace(sampler_factory=no_nvml)
    trace.start()
    trace.stop()
    trace.write_csv(tmp_path / "gpu.csv")
    assert (tmp_path / "gpu.csv").read_text().startswith("# NVML unavailable: ImportError")
    assert trace.summary()["available"] is False


def flag_values(flags: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, flag in enumerate(flags):
        if flag.startswith("--"):
            nxt = flags[i + 1] if i + 1 < len(flags) else None
            out[flag] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_vllm_client_flags_for_random():
    w = WorkloadConfig(
        dataset=DatasetConfig(num_prompts=100, random_input_len=256, random_output_len=64,
                              random_range_ratio=0.5, seed=3),
        max_concurrency=16, ignore_eos=True, num_warmups=2, extra_body={"top_k": 1},
        goodput={"ttft": 200.0}, metric_percentiles=(50.0, 99.0),
    )  # fmt: skip
    flags = vllm_bench_flags(w, "http://127.0.0.1:8001", "qwen", "/models/q")
    assert {f for f in flags if f.startswith("--")} <= VLLM_FLAGS
    v = flag_values(flags)
    assert v["--backend"] == "openai" and v["--endpoint"] == "/v1/completions"
    assert (v["--model"], v["--tokenizer"]) == ("qwen", "/models/q")
    assert v["--dataset-name"] == "random" and v["--random-range-ratio"] == "0.5"
    assert (v["--num-prompts"], v["--seed"], v["--max-concurrency"]) == ("100", "3", "16")
    assert v["--request-rate"] == "inf" and float(v["--request-rate"]) == math.inf
    assert v["--temperature"] == "0.0" and "--ignore-eos" in v
    assert v["--extra-body"] == '{"top_k": 1}' and v["--goodput"] == "ttft:200.0"
    assert (
        v["--percentile-metrics"] == "ttft,tpot,itl,e2el" and v["--metric-percentiles"] == "50,99"
    )


def test_vllm_client_command_for_other_datasets(tmp_path):
    w = WorkloadConfig(
        dataset=DatasetConfig(name="prefix-repetition", num_prompts=20),
        endpoint="/v1/chat/completions",
        temperature=None,
    )
    argv = vllm_bench_command(w, "http://h:1", None, "/tok", tmp_path / "A-vllm.json", "A-vllm")
    assert argv[:5] == [
        "env",
        "PYTHONPATH=/tmp/vllm-site",
        "python3",
        "-m",
        "vllm.entrypoints.cli.main",
    ]
    v = flag_values(argv[7:])
    assert set(v) <= VLLM_FLAGS
    assert v["--backend"] == "openai-chat" and v["--dataset-name"] == "prefix_repetition"
    assert "--temperature" not in v and "--model" not in v
    assert (v["--result-dir"], v["--result-filename"]) == (str(tmp_path), "A-vllm.json")
    assert "--save-result" in v and "--save-detailed" in v  # output lengths for the digest
    share = WorkloadConfig(dataset=DatasetConfig(name="sharegpt", path="/d.json"))
    v = flag_values(vllm_bench_flags(share, "http://h:1", "m", "/tok"))
    assert v["--dataset-path"] == "/d.json" and "--sharegpt-output-len" not in v


def fake_pynvml():
    """A stand-in for `pynvml` with one 80 GiB GPU, to run the NVML code path without a GPU."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    nvml.NVMLError = NVMLError
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: 1
    nvml.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87, memory=40)
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=2**30, total=80 * 2**30)
    nvml.nvmlDeviceGetPowerUsage = lambda h: 350_000  # mW
    nvml.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    nvml.nvmlSystemGetDriverVersion = lambda: "580.65.06"
    nvml.nvmlSystemGetCudaDriverVersion = lambda: 13000
    return nvml


def test_nvml_sampler_reads_through_pynvml(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    assert describe_gpus() == [
        "gpu 0: NVIDIA H100 80GB HBM3, 80.0 GiB",
        "driver: 580.65.06",
        "driver CUDA version: 13.0",
    ]
    trace = GpuTrace(interval_s=0.05)
    trace.start()
    time.sleep(0.2)
    trace.stop()
    assert trace.unavailable is None and trace.samples
    s = trace.samples[0]
    assert (s.gpu, s.util_pct, s.mem_used_mib, s.mem_total_mib, s.power_w) == (
        0,
        87,
        1024.0,
        81920.0,
        350.0,
    )
    assert "\ngpu 0: NVIDIA H100 80GB HBM3, 80.0 GiB\ndriver: 580.65.06\n" in environment_text({})
