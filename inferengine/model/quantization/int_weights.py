"""Integer weight-only linear layers (AWQ, GPTQ, compressed-tensors pack-quantized): the
checkpoint's packed tensors created at construction, filled shard by shard, repacked into the
kernels' layout (`kernels/int4_gemm.py`) once loaded.

A format (`awq.py`, `gptq.py`, `compressed_tensors.py`) lists its tensors as `Packed` specs
(which axis holds output features and how many per element, same for input features) and
turns them into `IntWeights`; this module does the rest. Fused layers (qkv, gate_up) take each
checkpoint part at its shard's output offset, so every shard's size must be a whole number of
packed words; tensor parallelism slices output features (column-parallel) or input features
and their groups (row-parallel). With act-order (`g_idx`) or one group per channel, a
row-parallel rank keeps every group's scales and zeros: its rows may use any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from inferengine.checkpoint.int_quant import IntCheckpoint
from inferengine.distributed.parallel_state import get_tp_size
from inferengine.errors import ModelLoadError
from inferengine.kernels.int4_gemm import IntWeights, int_linear_ref, pack_factor
from inferengine.model.layers.linear import RowParallelLinear, shape_of


@dataclass(frozen=True)
class Packed:
    """One checkpoint tensor of a layer. `out_per`/`in_per`: output/input features one element
    along `out_axis`/`in_axis` covers (a pack factor, a group size, or 1); an axis None: the
    tensor has no such axis. `whole_input`: every rank holds all of its input extent."""

    name: str
    out_axis: int | None
    out_per: int
    in_axis: int | None
    in_per: int
    dtype: torch.dtype | None = torch.int32  # None: the model's dtype (scales)
    whole_input: bool = False


class IntLinearMethod:
    """One layer's integer weights; a format subclass gives `tensors` and `kernel_layout`."""

    def __init__(self, checkpoint: IntCheckpoint):
        self.checkpoint = checkpoint
        self.bits = checkpoint.bits
        self.pack = pack_factor(checkpoint.bits)
        self.group_size = checkpoint.group_size

    def tensors(self, whole_input: bool) -> list[Packed]:
        """The checkpoint tensors of one layer. `whole_input`: scales and zeros (and g_idx)
        cover every input feature of the layer, not just this rank's."""
        raise NotImplementedError

    def kernel_layout(self, layer: nn.Module) -> IntWeights:
        """The loaded checkpoint tensors in the kernels' layout."""
        raise NotImplementedError

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        row_parallel = isinstance(layer, RowParallelLinear)
        tp = get_tp_size() if row_parallel else 1
        whole = self.group_size == -1 or (self.checkpoint.act_order and tp > 1)
        self._check_shape(layer, input_size, output_sizes, whole)
        rows = sum(output_sizes)
        specs = self.tensors(whole)
        layer.checkpoint_tensor_names = [spec.name for spec in specs]
        for spec in specs:
            shape = self._shape(spec, rows, input_size * tp if spec.whole_input else input_size)
            dtype = spec.dtype or torch.get_default_dtype()
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.weight_loader = _loader(layer, spec)
            param.dummy_init = _dummy(param, spec, self.group_size)
            setattr(layer, spec.name, param)

    def _shape(self, spec: Packed, rows: int, inputs: int) -> tuple[int, ...]:
        dims: dict[int, int] = {}
        if spec.out_axis is not None:
            dims[spec.out_axis] = rows // spec.out_per
        if spec.in_axis is not None:
            dims[spec.in_axis] = 1 if spec.in_per == -1 else inputs // spec.in_per
        return tuple(dims[axis] for axis in sorted(dims))

    def _check_shape(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], whole: bool
    ) -> None:
        problems = []
        if input_size % self.pack:
            problems.append(f"{input_size} input features are not whole {self.bits}-bit words")
        if not whole and self.group_size != -1 and input_size % self.group_size:
            problems.append(f"{input_size} input features are not whole groups of "
                            f"{self.group_size}")  # fmt: skip
        out_pack = self.output_pack()
        if any(size % out_pack for size in output_sizes):
            problems.append(f"output parts {output_sizes} are not whole words of {out_pack}")
        if problems:
            raise ModelLoadError(
                f"{layer.prefix}: {'; '.join(problems)} (this rank's shard, "
                f"{self.checkpoint.method} int{self.bits}); a smaller tensor-parallel size may fit."
            )

    def output_pack(self) -> int:
        """Output features packed in one element of any tensor (AWQ: 8)."""
        return 1

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int_linear_ref(x, self.weights(layer), bias)

    def weights(self, layer: nn.Module) -> IntWeights:
        return IntWeights(
            layer.qweight, layer.scales, layer.zeros, layer.g_idx, self.bits, self.group_size
        )

    def process_after_loading(self, layer: nn.Module) -> None:
        """Repack into the kernels' layout: the checkpoint's tensors go, `qweight`, `scales`,
        `zeros` and `g_idx` (a buffer, None without act-order) stay. Where the GPU kernels
        want another layout (act-order rows sorted by group, say), it is made here."""
        w = self.kernel_layout(layer)
        if w.g_idx is not None:
            groups = w.scales.shape[0]
            if int(w.g_idx.min()) < 0 or int(w.g_idx.max()) >= groups:
                raise ModelLoadError(f"{layer.prefix}: g_idx names groups outside 0..{groups - 1}")
        if not bool(torch.isfinite(w.scales).all()):
            raise ModelLoadError(f"{layer.prefix}: non-finite weight scales in the checkpoint")
        for name in layer.checkpoint_tensor_names:
            delattr(layer, name)
        layer.qweight = nn.Parameter(w.qweight.contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(w.scales.contiguous(), requires_grad=False)
        layer.zeros = nn.Parameter(w.zeros.contiguous(), requires_grad=False)
        layer.register_buffer("g_idx", None if w.g_idx is None else w.g_idx.int(), persistent=False)


def _loader(layer: nn.Module, spec: Packed) -> Callable[..., None]:
    def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        load_packed(layer, param, spec, loaded, shard_id)

    return load


def load_packed(
    layer: nn.Module, param: nn.Parameter, spec: Packed, loaded: Any, shard_id: Any
) -> None:
    """This rank's part of checkpoint tensor `loaded` (shard `shard_id` of a fused layer) into
    `param`: its output features at the shard's offset, its input features (row-parallel)."""
    place = layer.placement(shard_id)
    full = shape_of(loaded)
    index: list[slice] = [slice(None)] * len(full)
    target = param.data
    if spec.out_axis is not None:
        per = spec.out_per
        if place.offset % per or place.rows % per or place.first_row % per:
            raise ValueError(f"{spec.name}: shard rows {place} are not whole words of {per}")
        index[spec.out_axis] = slice(place.first_row // per, (place.first_row + place.rows) // per)
        target = target.narrow(spec.out_axis, place.offset // per, place.rows // per)
    if place.cols is not None and spec.in_axis is not None and not spec.whole_input:
        per = spec.in_per
        if place.first_col % per or place.cols % per:
            raise ValueError(f"{spec.name}: input columns {place} are not whole units of {per}")
        index[spec.in_axis] = slice(place.first_col // per, (place.first_col + place.cols) // per)
    if len(full) != target.dim():
        raise ValueError(f"{spec.name}: checkpoint shape {full}, parameter {tuple(param.shape)}")
    piece = loaded[tuple(index)]
    if tuple(piece.shape) != tuple(target.shape):
        raise ValueError(
            f"shape mismatch for {spec.name}: checkpoint {full} gives {tuple(piece.shape)} "
            f"for this shard, parameter part {tuple(target.shape)}"
        )
    if spec.out_axis is None:  # g_idx: one for every part of a fused layer (the same input)
        shared = layer.__dict__.setdefault("loaded_shared", set())
        if spec.name in shared and not torch.equal(target, piece.to(target.dtype)):
            raise ValueError(
                f"the parts of fused layer {layer.prefix} have different {spec.name} (act-order "
                "groups); they share an input, so a quantizer gives them the same"
            )
        shared.add(spec.name)
    target.copy_(piece)


def _dummy(param: nn.Parameter, spec: Packed, group_size: int) -> Callable[[Any], None]:
    """`--load-format dummy`: random packed values, small scales, groups in order."""

    def fill(generator: torch.Generator) -> None:
        if spec.name.endswith("g_idx"):
            rows = torch.arange(param.shape[0], device=param.device)
            param.data.copy_(rows // group_size if group_size > 0 else torch.zeros_like(rows))
        elif param.dtype == torch.int32:
            param.data.random_(generator=generator)
        else:
            param.data.fill_(0.004)

    return fill
