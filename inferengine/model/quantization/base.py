"""The seam between a weight format and the layers: a `QuantizationConfig` (one per model, chosen
in `choose.quant_config_for`) gives each layer a `QuantMethod` when the layer is built, and the
method creates the layer's parameters in its format, multiplies with them, and finishes them once
the checkpoint is in (as vLLM's `QuantizationConfig.get_quant_method` / `create_weights` /
`process_weights_after_loading`).

So weights are born in their format: an FP8 layer's weight is float8 from the start, and a
full-precision copy of the model never exists (each checkpoint tensor is quantized as its weight
loader takes it); a GGUF layer holds its packed blocks. Model files only pass the config and each
layer's name (`prefix`, the checkpoint's module name) down to the layers.

Formats: unquantized (`layers/linear.UnquantizedLinearMethod`), FP8 (`quantization/fp8.py`),
GGUF blocks on the CPU (`loader/gguf_quantized.py`), integer weight-only AWQ / GPTQ /
compressed-tensors pack-quantized (`quantization/formats.py`: packed int4/int8 weights, scales
and zeros created at construction, repacked for the kernels after loading).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

# A fused q/k/v layer's shard ids, in row order (`layers/linear.QKVParallelLinear`).
QKV_SHARD_IDS = {"q": 0, "k": 1, "v": 2}


class QuantMethod(Protocol):
    """One layer's weight format and matmul.

    A method may also define `takes_fp8_input(layer, x) -> bool`: when it says yes, the RMSNorm
    that makes x hands it over already quantized (`fp8_gemm.Fp8Input`), and `apply` must take
    that (FP8 does)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        """Register the layer's weight parameters (and buffers) for this rank's shard: `input_size`
        input features, `output_sizes` output features per fused part (one for a plain layer).
        Each parameter the checkpoint fills carries a `weight_loader(param, loaded, shard_id)`."""
        ...

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x Wᵀ + b with the layer's weights in this method's format."""
        ...

    def process_after_loading(self, layer: nn.Module) -> None:
        """The checkpoint's tensors are all in: repack, apply deferred scales, check."""
        ...


class QuantizationConfig:
    """A model's weight format: the method each layer gets at construction, and what the loader
    does around the checkpoint. The base is "unquantized everywhere"; a format overrides what it
    changes. `packed_modules`: the model class's `stacked_params` (checkpoint part, our fused
    module, shard id), so a fused layer's checkpoint names are known (`checkpoint_modules`)."""

    name = "none"

    def __init__(self, packed_modules: Iterable[tuple[str, str, Any]] = ()):
        self.packed_modules = tuple(packed_modules)

    def linear_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        """The method for linear layer `prefix` (our module name, e.g.
        `model.layers.0.self_attn.qkv_proj`); None: unquantized."""
        return None

    def experts_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        """The method for a mixture-of-experts layer's stacked experts; None: unquantized (the
        only kind the fused-experts kernels take today). May refuse the checkpoint."""
        return None

    def finish_construction(self, model: nn.Module) -> None:
        """After the model is built: check it can run in this format (raise if not), and swap
        in what its layers do not build themselves yet (a GGUF's block-quantized embedding and
        LM head)."""

    def skipped_checkpoint_names(self) -> frozenset[str]:
        """Checkpoint tensors the layers took elsewhere (e.g. from a GGUF), not to be read."""
        return frozenset()

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors as this format's loaders take them (renamed, some dropped)."""
        yield from weights

    def process_after_loading(self, model: nn.Module) -> None:
        """Once the checkpoint is in: every layer's `process_after_loading`."""
        process_after_loading(model)

    def describe(self) -> str:
        """For the load's log line, e.g. " with FP8 weights"."""
        return ""

    def checkpoint_modules(self, prefix: str, parts: int | None = None) -> list[str]:
        """The checkpoint's module names for our layer `prefix`, in row order: itself, or each
        part of a fused layer (`...qkv_proj` -> `...q_proj`, `...k_proj`, `...v_proj`).
        `parts`: the layer's fused part count; a fused layer whose parts the model's
        `packed_modules` do not all name gives [] (not a layout we know)."""
        return checkpoint_modules(prefix, self.packed_modules, parts)


def checkpoint_modules(
    prefix: str, packed_modules: Iterable[tuple[str, str, Any]], parts: int | None = None
) -> list[str]:
    """`QuantizationConfig.checkpoint_modules` for a model's `packed_modules`."""
    head, _, last = prefix.rpartition(".")
    shards = []
    for hf_part, our_part, shard_id in packed_modules:
        if our_part == last:
            index = QKV_SHARD_IDS[shard_id] if isinstance(shard_id, str) else shard_id
            shards.append((index, hf_part))
    if not shards:
        return [prefix]
    if parts is not None and len(shards) != parts:
        return []
    return [f"{head}.{hf_part}" if head else hf_part for _, hf_part in sorted(shards)]


def process_after_loading(model: nn.Module) -> None:
    """Each layer's quant method finishes its weights (layers without one are skipped)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        finish = getattr(method, "process_after_loading", None)
        if finish is not None:
            finish(module)


def join_prefix(prefix: str, name: str) -> str:
    """`prefix.name`, or `name` at the top."""
    return f"{prefix}.{name}" if prefix else name
