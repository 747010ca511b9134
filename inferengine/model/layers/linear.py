"""Linear layers with vLLM's names, each parameter carrying a `weight_loader` for HF shards.

Column-parallel layers split output features across tensor-parallel ranks, row-parallel ones
split input features and all-reduce. With one rank they are plain `F.linear`. Each layer holds
a `quant_method` that owns its weights' format and its matmul: unquantized here; the loader
swaps in another (FP8: `model/quantization/fp8.py`) before the weights come.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from inferengine.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from inferengine.model.layers.fused import use_fused_kernels


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ + b. Decode-sized inputs on CUDA take the skinny Triton GEMM, which reads the
    weights faster than cuBLAS does at a few rows (benchmarks/skinny_gemm.py)."""
    if use_fused_kernels(x):
        from inferengine.kernels.skinny_gemm import skinny_linear, supports

        if supports(x, weight):
            return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class LinearMethod(Protocol):
    """A layer's weight format and matmul. A method may also define
    `takes_fp8_input(layer, x) -> bool`: when it says yes, the RMSNorm that makes x hands it
    over already quantized (`fp8_gemm.Fp8Input`), and `apply` must take that (FP8 does)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x Wᵀ + b with the layer's weights in this method's format."""
        ...


class UnquantizedLinearMethod:
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias)


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


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's rows (output features) split across ranks."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__()
        tp = get_tp_size()
        for size in output_sizes:
            if size % tp:
                raise ValueError(
                    f"output size {size} is not divisible by tensor parallel size {tp}"
                )
        self.output_sizes = [s // tp for s in output_sizes]  # per-rank shard sizes
        self.weight = _param(sum(self.output_sizes), input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(sum(self.output_sizes)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
        self.quant_method: LinearMethod = UNQUANTIZED

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

    SHARD_IDS = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ):
        tp = get_tp_size()
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over {tp} ranks")
        # With more ranks than KV heads, each rank keeps one (replicated) KV head.
        self.kv_replicas = max(1, tp // num_kv_heads)
        kv_total = num_kv_heads * self.kv_replicas
        super().__init__(
            hidden_size, [num_heads * head_dim, kv_total * head_dim, kv_total * head_dim], bias
        )
        self.head_dim = head_dim

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

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        tp = get_tp_size()
        if input_size % tp:
            raise ValueError(
                f"input size {input_size} is not divisible by tensor parallel size {tp}"
            )
        self.input_size = input_size // tp
        self.weight = _param(output_size, self.input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader
        self.quant_method: LinearMethod = UNQUANTIZED

    def placement(self, shard_id: None = None) -> ShardPlacement:
        """Every row; this rank's columns."""
        rows, cols = self.weight.shape[0], self.input_size
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
