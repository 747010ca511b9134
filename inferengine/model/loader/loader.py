"""Builds a model on its device in its dtype and fills its weights."""

from __future__ import annotations

import time

import torch
from torch import nn

from inferengine.attention.backends.base import AttentionBackend
from inferengine.config import ModelConfig
from inferengine.logger import init_logger
from inferengine.model.llama import ModelInit
from inferengine.model.loader.gguf_floats import ensure_float_weights
from inferengine.model.loader.gguf_quantized import (
    install_gguf_linears,
    skip_names,
    wants_fp16_weights,
)
from inferengine.model.quantization.formats import fp8_checkpoint
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
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(ModelInit(model_config.hf_config, attn_backend))
    finally:
        torch.set_default_dtype(previous)
    # An FP8 checkpoint is FP8 even without the flag (a draft model's, say).
    checkpoint = fp8_checkpoint(model_config.hf_config)
    fp8 = model_config.quantization == "fp8" or checkpoint is not None
    if fp8:
        from inferengine.model.quantization import fp8 as fp8_layers

        fp8_layers.quantize_model(model, checkpoint, dtype)
    # A GGUF's quantized weights stay quantized on the CPU (unless FP8 was asked for); those names
    # are not read as floats.
    quantized = frozenset() if fp8 else install_gguf_linears(model, model_config, device, dtype)
    # Buffers computed in float32 (the rotary cos/sin table) stay float32.
    if model_config.load_format == "dummy":
        if hasattr(model, "materialize"):  # built on the meta device until its weights come
            model.materialize()
        init_dummy_weights(model, model_config.seed)
    else:
        from pathlib import Path

        wanted = skip_names(getattr(model, "wants_weight", None), quantized)
        ensure_float_weights(Path(model_config.model_path), wanted)  # a lean GGUF folder's
        weights = iterate_safetensors(Path(model_config.model_path), wanted)
        if fp8:
            weights = fp8_layers.checkpoint_tensors(weights, checkpoint)
        model.load_weights(weights)
    if fp8:
        fp8_layers.finish_loading(model)
    if not fp8 and not quantized and wants_fp16_weights(model_config, device, dtype):
        from inferengine.model.layers.fp16_cpu import pack_linears_fp16

        logger.info(
            "GGUF weights: %d linear layers as float16 under fbgemm's GEMM (float32 compute, "
            "half the bytes of float32); --gguf-dequantize keeps them float32",
            pack_linears_fp16(model),
        )
    model.eval()
    logger.info(
        "loaded %s (%s%s, %s) in %.2f s",
        model_config.architecture,
        model_config.dtype,
        " with FP8 weights" if fp8 else " with quantized GGUF weights" if quantized else "",
        "dummy weights" if model_config.load_format == "dummy" else "safetensors",
        time.perf_counter() - start,
    )
    return model
