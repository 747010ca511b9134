"""compressed-tensors `pack-quantized` linear layers (llm-compressor's W4A16 / W8A16):
symmetric int4/int8 weights per group or per channel, repacked into the kernels' layout.

Tensors per layer, K inputs, N outputs, p = 32 / bits: `weight_packed` int32 [N, K / p]
(input features packed, each value stored + 2^(bits-1)), `weight_scale` [N, K / g] (or
[N, 1] per channel), `weight_g_idx` int32 [K] with `actorder: group`, `weight_shape` (read
past); w = (q - 2^(bits-1)) * scale. FP8 `float-quantized` checkpoints are `fp8.py`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from inferengine.kernels.int4_gemm import IntWeights, repack_columns, unpack_int32
from inferengine.model.quantization.int_weights import IntLinearMethod, Packed


class PackQuantizedLinearMethod(IntLinearMethod):
    def tensors(self, whole_input: bool) -> list[Packed]:
        g = self.group_size
        specs = [
            Packed("weight_packed", out_axis=0, out_per=1, in_axis=1, in_per=self.pack),
            Packed("weight_scale", 0, 1, 1, g, dtype=None, whole_input=whole_input),
        ]
        if self.checkpoint.act_order:
            specs.append(Packed("weight_g_idx", None, 1, 0, 1))
        return specs

    def kernel_layout(self, layer: nn.Module) -> IntWeights:
        packed = layer.weight_packed.data  # [N, K / p]

        def unpack(block: slice) -> torch.Tensor:  # [K, block] of output rows `block`
            return unpack_int32(packed[block], self.bits, dim=1).t()

        columns, rows = packed.shape[0], packed.shape[1] * self.pack
        qweight = repack_columns(unpack, columns, rows, self.bits)
        scales = layer.weight_scale.data.t()
        zeros = torch.full_like(scales, float(1 << (self.bits - 1)))
        g_idx = layer.weight_g_idx.data if self.checkpoint.act_order else None
        return IntWeights(qweight, scales, zeros, g_idx, self.bits, self.group_size)


def pack_quantized_tensors(
    weights: Iterable[tuple[str, Any]], act_order: bool
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors as the layers take them: `weight_shape` (the unpacked shape,
    which the layer knows) dropped, and `weight_g_idx` without act-order groups."""
    for name, tensor in weights:
        if name.endswith(".weight_shape") or (not act_order and name.endswith(".weight_g_idx")):
            continue
        yield name, tensor
