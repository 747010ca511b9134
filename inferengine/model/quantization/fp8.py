"""FP8 linear layers: weights float8_e4m3fn [out, in] with one float32 scale per output row.

`Fp8Config` gives each column- and row-parallel linear an `Fp8LinearMethod` when the layer is
built (those the checkpoint's ignore list names stay unquantized), and the method creates the
FP8 weight and its scales there: no full-precision weight is ever allocated. Its loaders take
what the checkpoint holds, shard by shard (so fused qkv and gate_up keep each part's scales):
- 16/32-bit weights (and `--load-format dummy`): quantized per row as they load (a shard's
  float copy is the only one there is, and only while it loads);
- FP8 weights with per-tensor scales: kept as they are, the scale copied to each row (exact);
- FP8 weights with per-channel scales: kept as they are (exact);
- FP8 weights with block scales (`weight_scale_inv`, e.g. 128x128): dequantized and quantized
  again per row after loading (`process_after_loading`), one more rounding: the kernels take one
  scale per row.
Static `input_scale`s are not used: activations are always quantized per token, dynamically.
The LM head, embeddings, MoE experts and routers stay unquantized (an FP8 checkpoint of a
mixture-of-experts model is refused when its experts are built).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from inferengine.checkpoint.quantization import Fp8Checkpoint
from inferengine.errors import ModelLoadError
from inferengine.kernels.fp8_gemm import (
    FP8_DTYPE,
    Fp8Input,
    fp8_linear,
    quantize_rows,
    takes_fp8_input,
)
from inferengine.logger import init_logger
from inferengine.model.layers.linear import ShardPlacement, shape_of
from inferengine.model.quantization.base import QuantizationConfig

logger = init_logger(__name__)

# Static activation scales: read past, activations are quantized per token. (KV-cache scales,
# `k_scale` and the like, go on to the model's loader: `model/kv_scales.py`.)
_UNUSED_SUFFIXES = (".input_scale",)


class Fp8Config(QuantizationConfig):
    """FP8 weights for a model's linear layers: quantized on load from a 16/32-bit checkpoint
    (`checkpoint` None: `--quantization fp8`), or read from an FP8 checkpoint. `dtype`: the
    model's, in which dummy weights are drawn before they are quantized."""

    name = "fp8"

    def __init__(
        self,
        checkpoint: Fp8Checkpoint | None,
        dtype: torch.dtype,
        packed_modules: Iterable[tuple[str, str, Any]] = (),
    ):
        super().__init__(packed_modules)
        self.checkpoint = checkpoint
        self.dtype = dtype
        self._logged_experts = False

    def linear_method(self, layer: nn.Module, prefix: str) -> Fp8LinearMethod | None:
        if self.checkpoint is not None and self.checkpoint.ignores(self.checkpoint_modules(prefix)):
            return None
        return Fp8LinearMethod(self.checkpoint, self.dtype)

    def experts_method(self, layer: nn.Module, prefix: str) -> None:
        if self.checkpoint is not None:
            raise ModelLoadError(
                "FP8 checkpoints of mixture-of-experts models are not supported yet (their expert "
                "weights are FP8). Load the model's bf16 checkpoint with --quantization fp8, which "
                "quantizes the attention and dense layers and keeps the experts in bf16."
            )
        if not self._logged_experts:
            logger.info("FP8: the mixture-of-experts experts and routers stay in %s", self.dtype)
            self._logged_experts = True
        return None

    def finish_construction(self, model: nn.Module) -> None:
        if not any(isinstance(getattr(m, "quant_method", None), Fp8LinearMethod) for m in
                   model.modules()):  # fmt: skip
            raise ModelLoadError(
                f"{type(model).__name__} has no linear layers FP8 can take; run it unquantized."
            )

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """A checkpoint's tensors as the FP8 layers take them: `weight_scale_inv` (block scales)
        renamed `weight_scale`, static `input_scale`s dropped."""
        for name, tensor in weights:
            if name.endswith(_UNUSED_SUFFIXES):
                continue
            if name.endswith(".weight_scale_inv"):
                name = name.removesuffix("_inv")
            yield name, tensor

    def describe(self) -> str:
        return " with FP8 weights"


class Fp8LinearMethod:
    """One layer's FP8 weights: their parameters, loaders and matmul."""

    def __init__(self, checkpoint: Fp8Checkpoint | None, dtype: torch.dtype):
        self.checkpoint = checkpoint
        self.dtype = dtype
        # Block scales wait here until the weights they scale have loaded.
        self.pending_blocks: list[tuple[ShardPlacement, torch.Tensor]] = []

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        rows = sum(output_sizes)
        weight = nn.Parameter(torch.empty(rows, input_size, dtype=FP8_DTYPE), requires_grad=False)
        weight.weight_loader = lambda param, loaded, shard_id=None: self.load_weight(
            layer, loaded, shard_id
        )
        weight.dummy_dtype = self.dtype  # `init_dummy_weights` draws these in `dtype`...
        weight.quantize_from = lambda w: self.set_weight(layer, w)  # ...and hands them here
        # NaN until loaded: `process_after_loading` finds a layer whose scales never came.
        scale = nn.Parameter(
            torch.full((rows,), float("nan"), dtype=torch.float32), requires_grad=False
        )
        scale.weight_loader = lambda param, loaded, shard_id=None: self.load_scale(
            layer, loaded, shard_id
        )
        scale.optional_in_checkpoint = True  # filled with the weight when it is quantized here
        layer.weight = weight
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
        _quantize_into(layer.weight.data, layer.weight_scale.data, w)

    def load_weight(self, layer: nn.Module, loaded: Any, shard_id: Any) -> None:
        place = layer.placement(shard_id)
        rows = place.read(loaded, layer.weight.shape[1])  # on the host: moved a block at a time
        target = layer.weight.data.narrow(0, place.offset, place.rows)
        if rows.dtype == FP8_DTYPE:
            target.copy_(rows)  # its scale comes in its own tensor
            return
        if rows.dtype.itemsize == 1:
            raise ValueError(f"weights of {rows.dtype} are not supported (float8_e4m3fn is)")
        _quantize_into(target, layer.weight_scale.data.narrow(0, place.offset, place.rows), rows)

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

    def process_after_loading(self, layer: nn.Module) -> None:
        """Turn block-scaled weights into per-row ones; check every row got its scale."""
        for place, blocks in self.pending_blocks:
            self._requantize_blocks(layer, place, blocks)
        self.pending_blocks.clear()
        scale = layer.weight_scale.data
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ModelLoadError(
                f"{layer.prefix}: FP8 weights without (valid) weight scales; the checkpoint "
                "lacks weight_scale tensors, or its config.json's quantization_config does not "
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


# Rows quantized at a time: their float32 copy and its temporaries stay a few times 64 MiB
# (a 7B model's gate_up shard would take 2 GiB at once).
_QUANTIZE_ELEMENTS = 1 << 24


def _quantize_into(q: torch.Tensor, scale: torch.Tensor, w: torch.Tensor) -> None:
    """q [N, K] float8 and scale [N] := `quantize_rows(w)`, a block of rows at a time (each row
    is quantized alone, so the result is the same bits), on q's device."""
    step = max(1, _QUANTIZE_ELEMENTS // max(1, w.shape[1]))
    for start in range(0, w.shape[0], step):
        rows_q, rows_scale = quantize_rows(w[start : start + step].to(q.device))
        q[start : start + step].copy_(rows_q)
        scale[start : start + step].copy_(rows_scale)


def _read_whole(loaded: Any) -> torch.Tensor:
    """A whole checkpoint tensor (a safetensors slice of a 0-d scale takes `[()]`)."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    return loaded[()] if len(shape_of(loaded)) == 0 else loaded[:]
