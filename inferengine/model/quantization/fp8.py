"""FP8 linear layers: weights float8_e4m3fn [out, in] with one float32 scale per output row.

`quantize_model` gives each column- and row-parallel linear an `Fp8LinearMethod` before the
weights come. Its loaders take what the checkpoint holds, shard by shard (so fused qkv and
gate_up keep each part's scales):
- 16/32-bit weights (and `--load-format dummy`): quantized per row as they load;
- FP8 weights with per-tensor scales: kept as they are, the scale copied to each row (exact);
- FP8 weights with per-channel scales: kept as they are (exact);
- FP8 weights with block scales (`weight_scale_inv`, e.g. 128x128): dequantized and quantized
  again per row after loading (`finish_loading`), one more rounding: the kernels take one
  scale per row.
Static `input_scale`s are not used: activations are always quantized per token, dynamically.
The LM head, embeddings, MoE experts and routers stay unquantized.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from inferengine.errors import ModelLoadError
from inferengine.kernels.fp8_gemm import (
    FP8_DTYPE,
    Fp8Input,
    fp8_linear,
    quantize_rows,
    takes_fp8_input,
)
from inferengine.logger import init_logger
from inferengine.model.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardPlacement,
    shape_of,
)
from inferengine.model.layers.moe import FusedExperts
from inferengine.model.quantization.formats import Fp8Checkpoint

logger = init_logger(__name__)

# Static activation scales: read past, activations are quantized per token. (KV-cache scales,
# `k_scale` and the like, go on to the model's loader: `model/kv_scales.py`.)
_UNUSED_SUFFIXES = (".input_scale",)


class Fp8LinearMethod:
    """One layer's FP8 weights: their parameters, loaders and matmul."""

    def __init__(self, layer: nn.Module, checkpoint: Fp8Checkpoint | None, dtype: torch.dtype):
        self.checkpoint = checkpoint
        # Block scales wait here until the weights they scale have loaded.
        self.pending_blocks: list[tuple[ShardPlacement, torch.Tensor]] = []
        old = layer.weight
        weight = nn.Parameter(
            torch.empty(old.shape, dtype=FP8_DTYPE, device=old.device), requires_grad=False
        )
        weight.weight_loader = lambda param, loaded, shard_id=None: self.load_weight(
            layer, loaded, shard_id
        )
        weight.dummy_dtype = dtype  # `init_dummy_weights` draws these in `dtype`...
        weight.quantize_from = lambda w: self.set_weight(layer, w)  # ...and hands them here
        # NaN until loaded: `finish_loading` finds a layer whose scales never came.
        scale = nn.Parameter(
            torch.full((old.shape[0],), float("nan"), dtype=torch.float32, device=old.device),
            requires_grad=False,
        )
        scale.weight_loader = lambda param, loaded, shard_id=None: self.load_scale(
            layer, loaded, shard_id
        )
        scale.optional_in_checkpoint = True  # filled with the weight when it is quantized here
        layer.weight = weight  # keeps its place among the parameters (dummy weights' order)
        layer.weight_scale = scale

    def apply(
        self, layer: nn.Module, x: torch.Tensor | Fp8Input, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def takes_fp8_input(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether `apply` would quantize this x per token: the RMSNorm before may do it."""
        return takes_fp8_input(x, layer.weight)

    def set_weight(self, layer: nn.Module, w: torch.Tensor) -> None:
        """The whole (this rank's) weight from a float tensor of its shape."""
        q, scale = quantize_rows(w.to(layer.weight.device))
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scale)

    def load_weight(self, layer: nn.Module, loaded: Any, shard_id: Any) -> None:
        place = layer.placement(shard_id)
        rows = place.read(loaded, layer.weight.shape[1]).to(layer.weight.device)
        target = layer.weight.data.narrow(0, place.offset, place.rows)
        if rows.dtype == FP8_DTYPE:
            target.copy_(rows)  # its scale comes in its own tensor
            return
        if rows.dtype.itemsize == 1:
            raise ValueError(f"weights of {rows.dtype} are not supported (float8_e4m3fn is)")
        q, scale = quantize_rows(rows)
        target.copy_(q)
        layer.weight_scale.data.narrow(0, place.offset, place.rows).copy_(scale)

    def load_scale(self, layer: nn.Module, loaded: Any, shard_id: Any) -> None:
        """A checkpoint scale: per tensor (one value), per channel ([out] or [out, 1]) or, in
        a block-scaled checkpoint, per block ([⌈out/b⌉, ⌈in/b⌉])."""
        place = layer.placement(shard_id)
        scale = _read_whole(loaded).float().to(layer.weight.device)
        target = layer.weight_scale.data.narrow(0, place.offset, place.rows)
        if self.checkpoint is not None and self.checkpoint.weight_scales == "block":
            if scale.dim() != 2:
                raise ValueError(f"block scales must be 2-D, got shape {tuple(scale.shape)}")
            self.pending_blocks.append((place, scale))
        elif scale.numel() == 1:
            target.fill_(scale.item())
        elif scale.dim() == 1 or (scale.dim() == 2 and scale.shape[1] == 1):
            scale = scale.reshape(-1)
            if place.first_row + place.rows > scale.shape[0]:
                raise ValueError(f"{scale.shape[0]} per-channel scales are too few")
            target.copy_(scale[place.first_row : place.first_row + place.rows])
        else:
            raise ValueError(f"cannot read weight scales of shape {tuple(scale.shape)}")

    def finish_loading(self, layer: nn.Module, name: str) -> None:
        """Turn block-scaled weights into per-row ones; check every row got its scale."""
        for place, blocks in self.pending_blocks:
            self._requantize_blocks(layer, place, blocks)
        self.pending_blocks.clear()
        scale = layer.weight_scale.data
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ModelLoadError(
                f"{name}: FP8 weights without (valid) weight scales; the checkpoint lacks "
                "weight_scale tensors, or its config.json's quantization_config does not "
                "describe it."
            )

    def _requantize_blocks(
        self, layer: nn.Module, place: ShardPlacement, blocks: torch.Tensor
    ) -> None:
        assert self.checkpoint is not None and self.checkpoint.block_size is not None
        block_rows, block_cols = self.checkpoint.block_size
        weight = layer.weight.data.narrow(0, place.offset, place.rows)
        device = blocks.device
        row_ids = (torch.arange(place.rows, device=device) + place.first_row) // block_rows
        col_ids = (torch.arange(weight.shape[1], device=device) + place.first_col) // block_cols
        if int(row_ids[-1]) >= blocks.shape[0] or int(col_ids[-1]) >= blocks.shape[1]:
            raise ModelLoadError(
                f"block scales of shape {tuple(blocks.shape)} do not cover a weight shard of "
                f"{tuple(weight.shape)} in blocks of {self.checkpoint.block_size}."
            )
        for start in range(0, place.rows, block_rows):  # a block row at a time: little memory
            end = min(start + block_rows, place.rows)
            scales = blocks[row_ids[start:end]][:, col_ids]
            q, scale = quantize_rows(weight[start:end].float() * scales)
            weight[start:end].copy_(q)
            layer.weight_scale.data[place.offset + start : place.offset + end].copy_(scale)


def quantize_model(model: nn.Module, checkpoint: Fp8Checkpoint | None, dtype: torch.dtype) -> int:
    """Give every column- and row-parallel linear of `model` an FP8 method (those the
    checkpoint's ignore list names stay unquantized); the number of layers changed."""
    if checkpoint is not None and _has_experts(model):
        raise ModelLoadError(
            "FP8 checkpoints of mixture-of-experts models are not supported yet (their expert "
            "weights are FP8). Load the model's bf16 checkpoint with --quantization fp8, which "
            "quantizes the attention and dense layers and keeps the experts in bf16."
        )
    renames = _checkpoint_names(model)
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            continue
        if checkpoint is not None and checkpoint.ignores(_module_names(name, renames)):
            continue
        module.quant_method = Fp8LinearMethod(module, checkpoint, dtype)
        count += 1
    if count == 0:
        raise ModelLoadError(
            f"{type(model).__name__} has no linear layers FP8 can take; run it unquantized."
        )
    if _has_experts(model):
        logger.info("FP8: the mixture-of-experts experts and routers stay in %s", dtype)
    return count


def finish_loading(model: nn.Module) -> None:
    """After the weights: each FP8 layer's block scales applied and its scales checked."""
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, Fp8LinearMethod):
            method.finish_loading(module, name)


def checkpoint_tensors(
    weights: Iterable[tuple[str, Any]], checkpoint: Fp8Checkpoint | None
) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors as the FP8 layers take them: `weight_scale_inv` (block scales)
    renamed `weight_scale`, static `input_scale`s dropped."""
    for name, tensor in weights:
        if name.endswith(_UNUSED_SUFFIXES):
            continue
        if name.endswith(".weight_scale_inv"):
            name = name.removesuffix("_inv")
        yield name, tensor


def _has_experts(model: nn.Module) -> bool:
    return any(isinstance(m, FusedExperts) for m in model.modules())


def _read_whole(loaded: Any) -> torch.Tensor:
    """A whole checkpoint tensor (a safetensors slice of a 0-d scale takes `[()]`)."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    return loaded[()] if len(shape_of(loaded)) == 0 else loaded[:]


def _checkpoint_names(model: nn.Module) -> list[tuple[str, str]]:
    """(our fused module, checkpoint module) name pairs, from the model's stacked parameters
    (e.g. qkv_proj ← q_proj, k_proj, v_proj)."""
    return [(ours, hf) for hf, ours, _ in getattr(model, "stacked_params", ())]


def _module_names(name: str, renames: list[tuple[str, str]]) -> list[str]:
    """The checkpoint's names for our module `name` (a fused module has several)."""
    last = name.rsplit(".", 1)[-1]
    found = [name[: -len(last)] + hf for ours, hf in renames if ours == last]
    return found or [name]
