"""AWQ (AutoAWQ's GEMM packing) linear layers: int4 with zero points, read as the checkpoint
stores them and repacked into the kernels' layout after loading.

Tensors per layer, K inputs, N outputs, group g: `qweight` int32 [K, N / 8] and `qzeros`
int32 [K / g, N / 8], eight output columns per word in AWQ's interleaved order
(`AWQ_PACK_ORDER`), `scales` [K / g, N]; w = (q - zero) * scale.
"""

from __future__ import annotations

import torch
from torch import nn

from inferengine.kernels.int4_gemm import (
    AWQ_PACK_ORDER,
    IntWeights,
    repack_columns,
    unpack_int32,
)
from inferengine.model.quantization.int_weights import IntLinearMethod, Packed


class AwqLinearMethod(IntLinearMethod):
    def output_pack(self) -> int:
        return self.pack

    def tensors(self, whole_input: bool) -> list[Packed]:
        g = self.group_size
        return [
            Packed("qweight", out_axis=1, out_per=self.pack, in_axis=0, in_per=1),
            Packed("qzeros", 1, self.pack, 0, g, whole_input=whole_input),
            Packed("scales", 1, 1, 0, g, dtype=None, whole_input=whole_input),
        ]

    def kernel_layout(self, layer: nn.Module) -> IntWeights:
        packed = layer.qweight.data  # [K, N / 8]

        def unpack(block: slice) -> torch.Tensor:  # output columns block: whole words
            words = packed[:, block.start // 8 : block.stop // 8]
            return unpack_int32(words, 4, dim=1, order=AWQ_PACK_ORDER)

        rows, columns = packed.shape[0], packed.shape[1] * 8
        qweight = repack_columns(unpack, columns, rows, 4)
        zeros = unpack_int32(layer.qzeros.data, 4, dim=1, order=AWQ_PACK_ORDER)
        scales = layer.scales.data
        return IntWeights(qweight, scales, zeros.to(scales.dtype), None, 4, self.group_size)


def awq_dequantize_ref(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """An AWQ layer's weight [K, N] from its checkpoint tensors (AutoAWQ's own reading)."""
    q = unpack_int32(qweight, 4, dim=1, order=AWQ_PACK_ORDER).to(scales.dtype)
    zeros = unpack_int32(qzeros, 4, dim=1, order=AWQ_PACK_ORDER).to(scales.dtype)
    groups = torch.arange(q.shape[0], device=q.device) // group_size
    return (q - zeros[groups]) * scales[groups]
