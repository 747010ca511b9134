"""Which `QuantizationConfig` a load builds its model in: the run's quantization and the
checkpoint's format (`checkpoint/quantization.py`, read before anything loads) decide; the loader
hands the config to the model class (`ModelInit.quant_config`), whose layers ask it for their
methods."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from inferengine.checkpoint.quantization import fp8_checkpoint, int_quant_checkpoint
from inferengine.config import ModelConfig
from inferengine.model.quantization.base import QuantizationConfig


def quant_config_for(
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    packed_modules: Iterable[tuple[str, str, Any]] = (),
) -> QuantizationConfig | None:
    """FP8 for `--quantization fp8` or an FP8 checkpoint (which is FP8 without the flag: a draft
    model's, say); a converted GGUF's blocks on the CPU; else None (unquantized).
    `packed_modules`: the model class's `stacked_params` (its fused layers' checkpoint parts).
    An AWQ, GPTQ or compressed-tensors pack-quantized checkpoint: its integer weights."""
    integer = int_quant_checkpoint(model_config.hf_config)
    if integer is not None:
        from inferengine.model.quantization.formats import IntQuantConfig

        return IntQuantConfig(integer, packed_modules)
    checkpoint = fp8_checkpoint(model_config.hf_config)
    if model_config.quantization == "fp8" or checkpoint is not None:
        from inferengine.model.quantization.fp8 import Fp8Config

        return Fp8Config(checkpoint, dtype, packed_modules)
    # A GGUF's quantized weights stay quantized on the CPU (FP8, asked for, takes its floats).
    from inferengine.model.loader.gguf_quantized import gguf_quant_config

    return gguf_quant_config(model_config, device, dtype, packed_modules)
