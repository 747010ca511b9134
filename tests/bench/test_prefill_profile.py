"""benchmarks/prefill_profile.py: the plan's FLOPs (the MFU counting), the kernel kinds, the
summary of busy time and gaps, and a profile of the tiny model on the CPU."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script

profile = load_script("benchmarks/prefill_profile.py")


def test_dry_run_prints_the_steps_flops(capsys):
    assert profile.main(["--model", "configs/qwen2.5-7b", "--dry-run"]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    chunk = steps["chunk 8192"]
    # The hand count of tests/bench/test_bench_mfu.py: projections + one LM-head row; attention.
    assert chunk["gemm"] == 106_910_325_932_032 + 1_089_994_752
    assert chunk["attention"] == 13_470_661_607_424 and chunk["tokens"] == 8192
    mixed = steps["mixed"]
    assert mixed["tokens"] == 64 + 2048
    # 64 decodes see 2048 + 1 keys each; the chunk 2048 x 2049 / 2 pairs.
    assert mixed["attention"] == 28 * 4 * 28 * 128 * (64 * 2049 + 2048 * 2049 // 2)


def test_kernel_kinds():
    kind = profile.kind_of
    assert kind("paged_attention_kernel") == "attention"
    assert kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm" and kind("nvjet_tst_128x256") == "gemm"
    assert (
        kind("_rms_norm_kernel") == "norm" and kind("rotary_store_kv_kernel") == "rotary/kv-store"
    )
    assert kind("silu_and_mul_kernel") == "activation" and kind("memcpy") == "other"


def test_summary_counts_busy_time_and_gaps():
    # Two runs of two kernels: 10 us of GEMM, 5 of attention, 2 us idle between them.
    kernels = [("gemm_a", 0, 10), ("paged_attention", 12, 17), ("gemm_a", 100, 110),
               ("paged_attention", 112, 117)]  # fmt: skip
    flops = {"tokens": 1, "gemm": 10**9, "attention": 10**8}
    s = profile.summarise(kernels, flops, repeats=2)
    assert s["kernel_ms"] == {"attention": 0.005, "gemm": 0.01}
    assert s["span_ms"] == 0.017 and s["launch_gaps_ms"] == 0.002 and s["kernels_per_run"] == 2
    assert s["gemm_tflops"] == pytest.approx(10**9 / 10e-6 / 1e12)


def test_profile_of_the_tiny_model_on_the_cpu(tiny_checkpoint, tmp_path):
    argv = ["--model", str(tiny_checkpoint("qwen3")), "--max-model-len", "128", "--chunk", "64",
            "--mixed-chunk", "32", "--decodes", "2", "--decode-context", "16", "--repeats", "2",
            "--device", "cpu", "--out", str(tmp_path)]  # fmt: skip
    assert profile.main(argv) == 0
    result = json.loads((tmp_path / "profile.json").read_text())
    chunk = result["steps"]["chunk 64"]
    assert chunk["tokens"] == 64 and chunk["kernels_per_run"] > 0
    assert sum(chunk["kernel_ms"].values()) > 0 and result["steps"]["mixed"]["tokens"] == 34
