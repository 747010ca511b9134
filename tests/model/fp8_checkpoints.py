"""Pre-quantized FP8 copies of a tiny checkpoint, in the formats we load, each beside a float32
copy holding exactly the weights the FP8 one decodes to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from inferengine.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX, quantize_rows

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCHEMES = ("ct-channel", "ct-tensor", "hf-tensor", "hf-block")
BLOCK = (48, 48)  # not a divisor of 64 or 128: partial blocks at the edges and across shards


def is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().max() / FP8_MAX).float()
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (48 x 48) block: (FP8 weight, scales [⌈rows/48⌉, ⌈cols/48⌉])."""
    br, bc = BLOCK
    rows, cols = w.shape
    scales = torch.empty(-(-rows // br), -(-cols // bc))
    q = torch.empty(w.shape, dtype=FP8_DTYPE)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            scales[i, j] = block.abs().max() / FP8_MAX
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (block / scales[i, j]).to(FP8_DTYPE)
    return q, scales


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    br, bc = BLOCK
    rows = torch.arange(q.shape[0]) // br
    cols = torch.arange(q.shape[1]) // bc
    return q.float() * scales[rows][:, cols]


def quantization_config(scheme: str, ignore: list[str] | None = None) -> dict:
    if scheme.startswith("hf-"):
        config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static"}
        if scheme == "hf-block":
            config |= {"weight_block_size": list(BLOCK), "activation_scheme": "dynamic"}
        if ignore:
            config["modules_to_not_convert"] = ignore
        return config
    strategy = scheme.removeprefix("ct-")
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"type": "float", "num_bits": 8, "strategy": strategy},
                "input_activations": {"type": "float", "num_bits": 8, "dynamic": True},
            }
        },
        "ignore": ["lm_head", *(ignore or [])],
    }


def write_fp8_pair(
    src: Path, out: Path, scheme: str, ignore: tuple[str, ...] = ()
) -> tuple[Path, Path]:
    """(FP8 checkpoint, float32 checkpoint of its dequantized weights) made from `src`;
    projections whose name contains an `ignore` entry stay float in both."""
    fp8_dir, float_dir = out / f"{scheme}-fp8", out / f"{scheme}-float"
    for folder in (fp8_dir, float_dir):
        shutil.copytree(src, folder)
    tensors = load_file(src / "model.safetensors")
    fp8_tensors, float_tensors = {}, {}
    for name, w in tensors.items():
        fp8_tensors[name] = float_tensors[name] = w
        if not is_projection(name) or any(entry in name for entry in ignore):
            continue
        prefix = name.removesuffix(".weight")
        if scheme == "hf-block":
            q, scales = quantize_blocks(w)
            fp8_tensors[prefix + ".weight_scale_inv"] = scales
            float_tensors[name] = dequantize_blocks(q, scales)
        elif scheme == "ct-channel":
            q, scale = quantize_rows(w)
            fp8_tensors[prefix + ".weight_scale"] = scale.unsqueeze(1)  # [out, 1]
            float_tensors[name] = q.float() * scale[:, None]
        else:
            q, scale = quantize_tensor(w)
            shape = () if scheme == "hf-tensor" else (1,)
            fp8_tensors[prefix + ".weight_scale"] = scale.reshape(shape)
            if scheme == "hf-tensor":  # static activation scales: read, not used
                fp8_tensors[prefix + ".input_scale"] = torch.tensor(0.5)
            float_tensors[name] = q.float() * scale
        fp8_tensors[name] = q
    save_file(fp8_tensors, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(float_tensors, float_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme, list(ignore))
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, float_dir
