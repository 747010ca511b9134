"""Linear layers with vLLM's names, each parameter carrying a `weight_loader` for HF shards.

Column-parallel layers split output features across tensor-parallel ranks, row-parallel ones
split input features and all-reduce. With one rank they are plain `F.linear`. Each layer holds
a `quant_method` that owns its weights' format and its matmul, asked of the model's
`quant_config` when the layer is built (`model/quantization/base.py`): unquantized here, FP8
(`model/quantization/fp8.py`), GGUF blocks on the CPU (`model/loader/gguf_quantized.py`). The
method creates the weight parameters; the layer keeps the bias, its shard geometry
(`placement`) and the plain weight loaders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from inferengine.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from inferengine.model.layers.fused import use_fused_kernels
from inferengine.model.quantization.base import QKV_SHARD_IDS

if TYPE_CHECKING:
    from inferengine.model.quantization.base import QuantizationConfig, QuantMethod


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ + b. Decode-sized inputs on CUDA take the skinny Triton GEMM, which reads the
    weights faster than cuBLAS does at a few rows (benchmarks/skinny_gemm.py)."""
    if use_fused_kernels(x):
        from inferengine.kernels.skinny_gemm import skinny_linear, supports

        if supports(x, weight):
            return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class UnquantizedLinearMethod:
    """Full-precision weights [out, in] in the model's dtype (the default dtype the model is
    built under), filled by the layer's own weight loader."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        layer.weight = _param(sum(output_sizes), input_size)
        layer.weight.weight_loader = layer.weight_loader

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    def process_after_loading(self, layer: nn.Module) -> None:
        pass


UNQUANTIZED = UnquantizedLinearMethod()


@dataclass(frozen=True, slots=True)
class ShardPlacement:
    """Where this rank's part of one checkpoint tensor goes: parameter rows
    `[offset, offset + rows)` take checkpoint rows `[first_row, first_row + rows)` and, for a
    row-parallel rank, columns `[first_col, first_col + cols)` of the checkpoint's
    `checkpoint_cols`."""

    offset: int
    rows: int
    first_row: int
    first_col: int = 0
    cols: int | None = None  # None: every column
    checkpoint_cols: int | None = None

    def read(self, loaded: Any, width: int | None) -> torch.Tensor:
        """Those rows (and columns) of `loaded`; `width`: the parameter's columns, None for a
        vector. Raises ValueError when the checkpoint tensor's shape does not fit."""
        full = shape_of(loaded)
        if width is None:
            fits = len(full) == 1
        elif self.cols is None:
            fits = len(full) == 2 and full[1] == width
        else:
            fits = len(full) == 2 and self.cols == width and full[1] == self.checkpoint_cols
        if not fits or self.first_row + self.rows > full[0]:
            shard = (self.rows,) if width is None else (self.rows, width)
            raise ValueError(
                f"shape mismatch: parameter shard {shard} at row {self.first_row}, "
                f"checkpoint {full}"
            )
        rows = slice(self.first_row, self.first_row + self.rows)
        if self.cols is None:
            return loaded[rows]
        return loaded[rows, self.first_col : self.first_col + self.cols]


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def shape_of(loaded) -> tuple[int, ...]:
    """The shape of a checkpoint tensor: a torch tensor, or a safetensors slice not yet read
    (indexing one reads just those rows or columns, so a rank reads only its shard)."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_all(loaded) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def default_weight_loader(param: nn.Parameter, loaded) -> None:
    if tuple(param.shape) != shape_of(loaded):
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {shape_of(loaded)}"
        )
    param.data.copy_(read_all(loaded))


def make_quant_method(
    layer: nn.Module, quant_config: QuantizationConfig | None, prefix: str
) -> QuantMethod:
    """The method `quant_config` gives linear layer `prefix`; unquantized without one."""
    method = None if quant_config is None else quant_config.linear_method(layer, prefix)
    return UNQUANTIZED if method is None else method


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's rows (output features) split across ranks."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        tp = get_tp_size()
        for size in output_sizes:
            if size % tp:
                raise ValueError(
                    f"output size {size} is not divisible by tensor parallel size {tp}"
                )
        self.input_size = input_size
        self.output_sizes = [s // tp for s in output_sizes]  # per-rank shard sizes
        self.prefix = prefix
        self.quant_method = make_quant_method(self, quant_config, prefix)
        self.quant_method.create_weights(self, input_size, self.output_sizes)
        self.bias = _param(sum(self.output_sizes)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def shard_offset(self, shard_id: int) -> int:
        return sum(self.output_sizes[:shard_id])

    def placement(self, shard_id: int | str | None) -> ShardPlacement:
        """Where this rank's rows of checkpoint shard `shard_id` go."""
        if shard_id is None:
            if len(self.output_sizes) != 1:
                raise ValueError("a merged layer needs a shard id for each checkpoint tensor")
            shard_id = 0
        assert isinstance(shard_id, int)
        size = self.output_sizes[shard_id]
        return ShardPlacement(self.shard_offset(shard_id), size, get_tp_rank() * size)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int | str | None = None) -> None:
        """Copy this rank's rows of one checkpoint tensor (shard `shard_id`) into place."""
        place = self.placement(shard_id)
        width = param.shape[1] if param.dim() == 2 else None
        param.data.narrow(0, place.offset, place.rows).copy_(place.read(loaded, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (e.g. gate and up)."""


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matmul; shard ids are "q", "k", "v"."""

    SHARD_IDS = QKV_SHARD_IDS

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        tp = get_tp_size()
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over {tp} ranks")
        # With more ranks than KV heads, each rank keeps one (replicated) KV head.
        self.kv_replicas = max(1, tp // num_kv_heads)
        self.head_dim = head_dim
        kv_total = num_kv_heads * self.kv_replicas
        sizes = [num_heads * head_dim, kv_total * head_dim, kv_total * head_dim]
        super().__init__(hidden_size, sizes, bias, quant_config, prefix)

    def placement(self, shard_id: int | str | None) -> ShardPlacement:
        index = self.SHARD_IDS[shard_id] if isinstance(shard_id, str) else shard_id
        if index and self.kv_replicas > 1:
            # This rank's one KV head, which `kv_replicas` neighbouring ranks share.
            head = get_tp_rank() // self.kv_replicas
            return ShardPlacement(
                self.shard_offset(index), self.output_sizes[index], head * self.head_dim
            )
        return super().placement(index)


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's columns (input features) split across ranks, then all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        tp = get_tp_size()
        if input_size % tp:
            raise ValueError(
                f"input size {input_size} is not divisible by tensor parallel size {tp}"
            )
        self.input_size = input_size // tp  # this rank's columns
        self.output_size = output_size
        self.output_sizes = [output_size]
        self.prefix = prefix
        self.quant_method = make_quant_method(self, quant_config, prefix)
        self.quant_method.create_weights(self, self.input_size, self.output_sizes)
        self.bias = _param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def placement(self, shard_id: None = None) -> ShardPlacement:
        """Every row; this rank's columns."""
        rows, cols = self.output_size, self.input_size
        return ShardPlacement(0, rows, 0, get_tp_rank() * cols, cols, cols * get_tp_size())

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        full = shape_of(loaded)
        tp = get_tp_size()
        if len(full) != 2 or full[1] != self.input_size * tp:
            raise ValueError(
                f"shape mismatch: parameter {(param.shape[0], self.input_size * tp)}, "
                f"checkpoint {full}"
            )
        start = get_tp_rank() * self.input_size
        default_weight_loader(param, loaded[:, start : start + self.input_size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, None)
        y = tp_all_reduce(y)
        # The bias is added once, after the reduction.
        return y if self.bias is None else y + self.bias
