"""FP8 KV cache scales in checkpoints: recognised by name, taken out of the weight stream and set
on each layer's attention, where an fp8 cache uses them (kernels/kv_quant.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from inferengine.attention.layer import Attention
from inferengine.errors import ModelLoadError
from inferengine.logger import init_logger

logger = init_logger(__name__)

# Checkpoint name suffix -> the scales it gives: compressed-tensors (`self_attn.k_scale`),
# NVIDIA ModelOpt (`k_proj.k_scale`), older compressed-tensors (`k_proj.output_scale`) and
# AutoFP8's one scale for both (`kv_scale`).
SCALE_SUFFIXES = (
    (".self_attn.k_proj.k_scale", ("k",)),
    (".self_attn.v_proj.v_scale", ("v",)),
    (".self_attn.k_proj.output_scale", ("k",)),
    (".self_attn.v_proj.output_scale", ("v",)),
    (".self_attn.k_scale", ("k",)),
    (".self_attn.v_scale", ("v",)),
    (".self_attn.kv_scale", ("k", "v")),
)
# Scales for fp8 queries and probabilities, which the attention here keeps in the model dtype.
IGNORED_SUFFIXES = (".self_attn.q_scale", ".self_attn.prob_scale", ".self_attn.q_proj.output_scale")


def _read_scales(name: str, tensor: Any) -> torch.Tensor:
    """The values of checkpoint tensor `name` (a torch tensor or a safetensors slice)."""
    value = (tensor if isinstance(tensor, torch.Tensor) else tensor[...]).float()
    if value.numel() == 0 or not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
        raise ModelLoadError(f"checkpoint tensor {name} is not a positive KV cache scale.")
    return value


class KVScales:
    """`take` passes the weights through without the KV cache scales, keeping them; `apply`
    then sets them on the attention layers."""

    def __init__(self) -> None:
        self.found: dict[str, dict[str, float]] = {}  # self_attn module name -> {"k": s, "v": s}
        self.per_head: str | None = None  # a scale tensor with several values, if any

    def take(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            for suffix, which in SCALE_SUFFIXES:
                if name.endswith(suffix):
                    module = name[: -len(suffix)] + ".self_attn"
                    values = _read_scales(name, tensor)
                    if values.numel() > 1:
                        self.per_head = name
                    # One scale per layer here: of per-head ones, the largest never saturates.
                    scale = float(values.max())
                    self.found.setdefault(module, {}).update(dict.fromkeys(which, scale))
                    break
            else:
                yield name, tensor

    def apply(self, model: nn.Module) -> None:
        for module_name, scales in self.found.items():
            try:
                attn = getattr(model.get_submodule(module_name), "attn", None)
            except AttributeError:
                attn = None
            if not isinstance(attn, Attention):
                raise ModelLoadError(
                    f"the checkpoint has KV cache scales for {module_name}, which is not an "
                    "attention layer of this model; is config.json the one for these weights?"
                )
            attn.set_kv_scales(scales.get("k", 1.0), scales.get("v", 1.0))
        if self.per_head is not None:
            logger.warning(
                "the checkpoint's KV cache scales are per head (e.g. %s); each layer uses its "
                "largest",
                self.per_head,
            )
        if self.found:
            logger.info(
                "KV cache scales from the checkpoint for %d layers (used with --kv-cache-dtype "
                "fp8, ignored otherwise)",
                len(self.found),
            )
