"""GPTQ linear layers (AutoGPTQ / GPTQModel's `gptq` and `gptq_v2` checkpoints): 4- or 8-bit,
symmetric or not, act-order groups from `g_idx`; already the kernels' layout.

Tensors per layer, K inputs, N outputs, group g, p = 32 / bits values per word: `qweight`
int32 [K / p, N] (input rows packed), `qzeros` int32 [K / g, N / p] (output columns packed;
v1 stores zero - 1), `scales` [K / g, N], `g_idx` int32 [K] (each input row's group; read
only with `desc_act`, else groups are k // g); w = (q - zero) * scale.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from inferengine.kernels.int4_gemm import IntWeights, unpack_int32
from inferengine.model.quantization.int_weights import IntLinearMethod, Packed


class GptqLinearMethod(IntLinearMethod):
    def tensors(self, whole_input: bool) -> list[Packed]:
        g = self.group_size
        specs = [
            Packed("qweight", out_axis=1, out_per=1, in_axis=0, in_per=self.pack),
            Packed("qzeros", 1, self.pack, 0, g, whole_input=whole_input),
            Packed("scales", 1, 1, 0, g, dtype=None, whole_input=whole_input),
        ]
        if self.checkpoint.act_order:
            specs.append(Packed("g_idx", None, 1, 0, 1))
        return specs

    def kernel_layout(self, layer: nn.Module) -> IntWeights:
        scales = layer.scales.data
        zeros = unpack_int32(layer.qzeros.data, self.bits, dim=1).to(scales.dtype)
        zeros += self.checkpoint.zeros_offset
        g_idx = layer.g_idx.data if self.checkpoint.act_order else None
        return IntWeights(layer.qweight.data, scales, zeros, g_idx, self.bits, self.group_size)


def gptq_tensors(weights: Iterable[tuple[str, Any]], act_order: bool) -> Iterator[tuple[str, Any]]:
    """A GPTQ checkpoint's tensors as the layers take them: `g_idx` dropped without act-order
    (it only says k // group_size there, in the full model's numbering)."""
    for name, tensor in weights:
        if not act_order and name.endswith(".g_idx"):
            continue
        yield name, tensor
