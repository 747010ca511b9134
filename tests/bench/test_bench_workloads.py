"""The named workloads as `vllm bench serve` receives them, and the server lengths they need;
the environment the harness gives servers and the judge."""

from __future__ import annotations

import itertools

import pytest

from inferengine.bench.host import child_env, probe_device
from inferengine.bench.vllm_client import vllm_bench_flags
from inferengine.bench.workloads import WORKLOADS

# workload -> (prompt, output, range ratio, concurrency, the server's --max-model-len)
NEW = {
    "rag": (2048, 128, 0.25, 32, 4096),
    "prefill-only": (8192, 1, 0.0, 16, 8448),
    "batch1-8k": (8192, 16, 0.0, 1, 8448),
    "long-prompt": (6144, 128, 0.0, 8, 8192),
}


@pytest.mark.parametrize("name", list(NEW))
def test_long_workloads_as_vllm_flags(name):
    prompt, output, ratio, concurrency, max_len = NEW[name]
    w = WORKLOADS[name].workload
    flags = vllm_bench_flags(w, "http://h:1", "m", "/tok")
    pairs = dict(itertools.pairwise(flags))
    assert pairs["--dataset-name"] == "random" and "--ignore-eos" in flags
    assert pairs["--random-input-len"] == str(prompt)
    assert pairs["--random-output-len"] == str(output)
    assert pairs["--random-range-ratio"] == str(ratio)
    assert pairs["--max-concurrency"] == str(concurrency)
    assert pairs["--temperature"] == "0.0" and int(pairs["--num-warmups"]) > 0
    # The longest request vLLM's range allows fits the server length the description names.
    assert round(prompt * (1 + ratio)) + round(output * (1 + ratio)) <= max_len
    assert f"--max-model-len {max_len}" in WORKLOADS[name].description or name == "rag"


def test_rag_and_prefill_only_descriptions():
    assert WORKLOADS["rag"].description.startswith("128 prompts, in 2048 ±25%, out 128 ±25%")
    assert "out 1," in WORKLOADS["prefill-only"].description
    assert "median TTFT" in WORKLOADS["batch1-8k"].description


def test_child_env_leaves_out_what_only_the_harness_sets(monkeypatch):
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    monkeypatch.setenv("INFERENGINE_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("VLLM_SOMETHING", "1")
    monkeypatch.setenv("HOME_LIKE", "kept")
    ours, theirs = child_env(vllm=False), child_env(vllm=True)
    assert "PYTHONUNBUFFERED" not in ours and "PYTHONUNBUFFERED" not in theirs
    assert ours["INFERENGINE_MAX_NUM_SEQS"] == "8" and ours["VLLM_SOMETHING"] == "1"
    assert "INFERENGINE_MAX_NUM_SEQS" not in theirs and "VLLM_SOMETHING" not in theirs
    assert ours["HOME_LIKE"] == theirs["HOME_LIKE"] == "kept"


def test_no_probe_without_an_nvidia_device(monkeypatch):
    monkeypatch.setattr("inferengine.bench.host.has_nvidia_device", lambda: False)
    assert probe_device() == {
        "copy_gbps": None, "bf16_matmul_tflops": None, "reason": "no NVIDIA device"
    }  # fmt: skip
