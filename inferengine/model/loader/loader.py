"""Builds a model on its device in its dtype, its layers in their weight format, and fills its
weights."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from inferengine.attention.backends.base import AttentionBackend
from inferengine.config import ModelConfig
from inferengine.logger import init_logger
from inferengine.model.llama import ModelInit
from inferengine.model.loader.gguf_floats import ensure_float_weights
from inferengine.model.loader.gguf_quantized import skip_names
from inferengine.model.quantization.choose import quant_config_for
from inferengine.model.registry import resolve_model_class
from inferengine.model.weights import init_dummy_weights, iterate_safetensors

logger = init_logger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    model_config: ModelConfig, device: torch.device, attn_backend: AttentionBackend
) -> nn.Module:
    start = time.perf_counter()
    cls = resolve_model_class(model_config.hf_config, model_config.model_impl)
    dtype = TORCH_DTYPES[model_config.dtype]
    # The layers are created in their format (FP8, GGUF blocks): no full-precision copy of a
    # quantized model is ever built.
    quant_config = quant_config_for(model_config, device, dtype, getattr(cls, "stacked_params", ()))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(ModelInit(model_config.hf_config, attn_backend, quant_config))
    finally:
        torch.set_default_dtype(previous)
    if quant_config is not None:
        quant_config.finish_construction(model)
    # Buffers computed in float32 (the rotary cos/sin table) stay float32.
    if model_config.load_format == "dummy":
        if hasattr(model, "materialize"):  # built on the meta device until its weights come
            model.materialize()
        init_dummy_weights(model, model_config.seed)
    else:
        # Weights a layer took elsewhere (a GGUF's blocks) are not read as floats.
        skipped = frozenset() if quant_config is None else quant_config.skipped_checkpoint_names()
        wanted = skip_names(getattr(model, "wants_weight", None), skipped)
        ensure_float_weights(Path(model_config.model_path), wanted)  # a lean GGUF folder's
        weights = iterate_safetensors(Path(model_config.model_path), wanted)
        if quant_config is not None:
            weights = quant_config.checkpoint_tensors(weights)
        model.load_weights(weights)
    if quant_config is not None:
        quant_config.process_after_loading(model)
    model.eval()
    logger.info(
        "loaded %s (%s%s, %s) in %.2f s",
        model_config.architecture,
        model_config.dtype,
        "" if quant_config is None else quant_config.describe(),
        "dummy weights" if model_config.load_format == "dummy" else "safetensors",
        time.perf_counter() - start,
    )
    return model
