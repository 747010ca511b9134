"""SiLU-and-multiply: the gated activation of Llama-style MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferengine.kernels.cpu_native import cpu_ops
from inferengine.model.layers.fused import use_fused_kernels


class SiluAndMul(nn.Module):
    """[..., 2·d] → silu(gate) · up, with gate the first half and up the second."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x):
            from inferengine.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        ops = cpu_ops(x)
        if ops is not None and x.is_contiguous():
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
