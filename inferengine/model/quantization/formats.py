"""The integer weight-only formats we read, and the `QuantizationConfig` that gives each linear
layer its method: AWQ, GPTQ and compressed-tensors pack-quantized (`checkpoint/int_quant.py`
says which a checkpoint is, before anything loads)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from inferengine.checkpoint.int_quant import IntCheckpoint
from inferengine.errors import ModelLoadError
from inferengine.model.quantization.awq import AwqLinearMethod
from inferengine.model.quantization.base import QuantizationConfig
from inferengine.model.quantization.compressed_tensors import (
    PackQuantizedLinearMethod,
    pack_quantized_tensors,
)
from inferengine.model.quantization.gptq import GptqLinearMethod, gptq_tensors
from inferengine.model.quantization.int_weights import IntLinearMethod

LINEAR_METHODS: dict[str, type[IntLinearMethod]] = {
    "awq": AwqLinearMethod,
    "gptq": GptqLinearMethod,
    "compressed-tensors": PackQuantizedLinearMethod,
}


class IntQuantConfig(QuantizationConfig):
    """Integer weights for a model's linear layers, read from the checkpoint as they are
    stored; the layers its ignore list (or targets) leave out, the LM head and embeddings stay
    in the model's dtype."""

    def __init__(
        self, checkpoint: IntCheckpoint, packed_modules: Iterable[tuple[str, str, Any]] = ()
    ):
        super().__init__(packed_modules)
        self.checkpoint = checkpoint
        self.name = checkpoint.method
        self.method_class = LINEAR_METHODS[checkpoint.method]

    def linear_method(self, layer: nn.Module, prefix: str) -> IntLinearMethod | None:
        names = self.checkpoint_modules(prefix, len(getattr(layer, "output_sizes", [1])))
        if not names:
            raise ModelLoadError(f"{prefix}: a fused layer whose checkpoint parts are unknown")
        if not self.checkpoint.quantizes(names):
            return None
        return self.method_class(self.checkpoint)

    def experts_method(self, layer: nn.Module, prefix: str) -> None:
        raise ModelLoadError(
            f"{self.checkpoint.method} checkpoints of mixture-of-experts models are not "
            "supported yet (their experts are int-quantized); load the model's bf16 checkpoint."
        )

    def finish_construction(self, model: nn.Module) -> None:
        self.model_params = {name for name, _ in model.named_parameters()}
        if not any(isinstance(getattr(m, "quant_method", None), IntLinearMethod)
                   for m in model.modules()):  # fmt: skip
            raise ModelLoadError(
                f"{type(model).__name__}: the {self.checkpoint.method} checkpoint quantizes none "
                "of its linear layers (check quantization_config's ignore/targets)."
            )

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        weights = self._without_extra_biases(weights)
        if self.checkpoint.method == "compressed-tensors":
            return pack_quantized_tensors(weights, self.checkpoint.act_order)
        if self.checkpoint.method == "gptq":
            return gptq_tensors(weights, self.checkpoint.act_order)
        return weights

    def _without_extra_biases(
        self, weights: Iterable[tuple[str, Any]]
    ) -> Iterator[tuple[str, Any]]:
        """AutoGPTQ (and some AWQ exports) save a bias for every quantized projection, zeros
        where the model has none: those are read past, as vLLM does."""
        params = getattr(self, "model_params", None)
        for name, tensor in weights:
            if params is not None and name.endswith(".bias") and name not in params:
                target = name
                for hf_part, our_part, _ in self.packed_modules:
                    target = target.replace(f".{hf_part}.", f".{our_part}.")
                if target not in params:
                    continue
            yield name, tensor

    def describe(self) -> str:
        return self.checkpoint.describe()
