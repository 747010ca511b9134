"""MFU of a prefill-only run: the model FLOPs of the Qwen2.5-7B shape counted by hand, and the
share of a measured peak that a judge's result gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferengine.bench.mfu import bf16_matmul_peak_tflops, main, prefill_mfu, prompt_flops

QWEN = json.loads(Path("configs/qwen2.5-7b/config.json").read_text())

# By hand, Qwen2.5-7B (hidden 3584, 28 layers, 28 heads x 128, 4 KV heads, MLP 18944, vocab
# 152064): one layer's projections hold q 3584^2 + k, v 2 x 3584 x 512 + o 3584^2 + gate, up,
# down 3 x 3584 x 18944 = 25,690,112 + 3,670,016 + 203,685,888 = 233,046,016 weights.
LAYER_WEIGHTS = 233_046_016
# A prompt of 8192 tokens: matmuls 2 x 233,046,016 x 28 x 8192; causal attention 28 layers x
# (QK^T + PV: 2 x 2 x 28 heads x 128) x 8192 x 8193 / 2 pairs; the LM head once, 2 x 3584 x 152064.
MATMUL_8K = 106_910_325_932_032
ATTENTION_8K = 13_470_661_607_424
LM_HEAD = 1_089_994_752


def test_qwen_prompt_flops_match_the_hand_count():
    flops = prompt_flops(QWEN, 8192)
    assert flops.matmul == MATMUL_8K == 2 * LAYER_WEIGHTS * 28 * 8192
    assert flops.attention == ATTENTION_8K
    assert flops.lm_head == LM_HEAD
    assert flops.total == 120_382_077_534_208  # 14.7 GFLOP a token, 11.2% of it attention
    # The projections, embedding and LM head: the 7.61 B weights of Qwen2.5-7B (norms, biases aside).
    assert LAYER_WEIGHTS * 28 + 2 * 3584 * 152064 == 7_615_283_200


def test_attention_grows_with_the_square_of_the_prompt():
    short, long = prompt_flops(QWEN, 1024), prompt_flops(QWEN, 8192)
    assert long.matmul == 8 * short.matmul
    assert long.attention / short.attention == pytest.approx(64 * 8193 / 1025 / 8, rel=1e-12)


def test_prefill_mfu_of_a_judge_result():
    # 128 prompts of 8192 tokens in 20 s against a measured 800 TFLOP/s.
    result = {"completed": 128, "total_input_tokens": 128 * 8192, "duration": 20.0}
    mfu = prefill_mfu(QWEN, result, 800.0)
    achieved = 120_382_077_534_208 * 128 / 20.0 / 1e12  # 770.4 TFLOP/s
    assert mfu["model_tflops_per_s"] == pytest.approx(achieved)
    assert mfu["mfu_pct"] == pytest.approx(100 * achieved / 800.0)
    assert mfu["prompt_len"] == 8192 and mfu["attention_share"] == pytest.approx(0.1119, abs=1e-4)
    assert prefill_mfu(QWEN, result, None)["mfu_pct"] is None
    assert prefill_mfu(QWEN, {"completed": 0}, 800.0)["mfu_pct"] is None


def test_unknown_architectures_are_refused():
    with pytest.raises(ValueError, match="gemma3"):
        prompt_flops({**QWEN, "model_type": "gemma3"}, 16)


def test_the_peak_needs_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("measured on the GPU host")
    assert bf16_matmul_peak_tflops() is None
    assert main(["peak"]) == 0
    assert json.loads(capsys.readouterr().out)["bf16_matmul_tflops"] is None
    assert main([]) == 2


def test_the_summary_gives_each_system_its_mfu_over_its_gpus():
    from inferengine.bench.paired import mfu_entry
    from inferengine.bench.paired_launch import PairedConfig
    from inferengine.bench.summary import format_summary
    from inferengine.bench.systems import SystemSpec
    from inferengine.bench.workloads import WORKLOADS

    systems = [SystemSpec("a", "serve x"), SystemSpec("b", "serve x --tensor-parallel-size 2")]
    cfg = PairedConfig(systems, [WORKLOADS["prefill-only"]], "tok", model_dir="configs/qwen2.5-7b")
    metrics = {"completed": 128, "total_input_tokens": 128 * 8192, "duration": 20.0}
    entry = {"systems": {s.name: {"runs": [{"metrics": metrics}] * 3} for s in systems}}
    mfu = mfu_entry(cfg, entry, 800.0)
    one = 100 * 120_382_077_534_208 * 128 / 20.0 / 1e12 / 800.0
    assert mfu["a"]["mfu_pct"] == {"median": pytest.approx(one), "min": pytest.approx(one),
                                   "max": pytest.approx(one), "n": 3}  # fmt: skip
    assert mfu["b"]["gpus"] == 2 and mfu["b"]["mfu_pct"]["median"] == pytest.approx(one / 2)
    summary = {
        "judge": "j", "runs_per_system": 3, "systems": ["a", "b"], "ready_s": {"a": {}, "b": {}},
        "workloads": {"prefill-only": {
            "description": "d", "systems": {s: {"spread": {}} for s in "ab"}, "ratios": {},
            "gates": [], "mfu": mfu,
        }},
    }  # fmt: skip
    text = format_summary(summary)
    assert "MFU, % of the measured bf16 matmul peak of 800 TFLOP/s: a 96.31 [96.31-96.31]" in text
