"""compressed-tensors checkpoints on the CPU against Transformers on their dequantized weights:
pack-quantized int4/int8 (W4A16, W8A16) and float-quantized FP8 (per-channel weights, dynamic
or static activation scales)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.fp8_checkpoints import write_fp8_pair
from tests.model.quantization.int_checkpoints import Scheme, write_int_pair
from tests.model.quantization.int_checks import check_against_transformers

SCHEMES = {
    "w4a16-g32": Scheme("compressed-tensors", 4, 32),
    "w8a16-channel": Scheme("compressed-tensors", 8, -1),
    "w4a16-g64-actorder": Scheme("compressed-tensors", 4, 64, desc_act=True),
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_pack_quantized_greedy_equals_transformers(float_source, tmp_path, name):
    scheme = SCHEMES[name]
    q_dir, float_dir = write_int_pair(float_source("qwen2"), tmp_path, scheme, name)
    check_against_transformers(q_dir, float_dir, scheme)


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_fp8_float_quantized_greedy_equals_transformers(float_source, tmp_path, activations):
    """Per-channel FP8 weights; static activation scales are read and not used (activations
    are quantized per token on a GPU, and not at all on the CPU)."""
    fp8_dir, float_dir = write_fp8_pair(float_source("qwen2"), tmp_path, "ct-channel")
    if activations == "static":
        config = json.loads((fp8_dir / "config.json").read_text())
        group = config["quantization_config"]["config_groups"]["group_0"]
        group["input_activations"] = {"type": "float", "num_bits": 8, "dynamic": False}
        (fp8_dir / "config.json").write_text(json.dumps(config))
        tensors = load_file(fp8_dir / "model.safetensors")
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            tensors[name.replace(".weight_scale", ".input_scale")] = torch.tensor([0.02])
        save_file(tensors, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    check_against_transformers(fp8_dir, float_dir, None)
