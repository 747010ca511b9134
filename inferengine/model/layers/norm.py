"""RMSNorm with an optional fused residual add, computed in float32 like Transformers (one
Triton kernel on CUDA, one C++ op on the CPU where our kernels load)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferengine.kernels.cpu_native import cpu_ops
from inferengine.kernels.fp8_gemm import Fp8Input
from inferengine.model.layers.fused import use_fused_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # The same ops in the same order, run by torch in C++: one Python call, not six.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        fp8_consumer: nn.Module | None = None,
    ) -> torch.Tensor | Fp8Input | tuple[torch.Tensor | Fp8Input, torch.Tensor]:
        """`norm(x)`, or with a residual: `(norm(x + residual), x + residual)`.

        On CUDA one fused kernel does both, in place on `x` and `residual`. `fp8_consumer`: the
        linear that alone reads the result; when its quant method would quantize it per token
        (`takes_fp8_input`), the kernel hands it over quantized (`fp8_gemm.Fp8Input`) instead.
        """
        if use_fused_kernels(x):
            from inferengine.kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_fp8

            takes = getattr(getattr(fp8_consumer, "quant_method", None), "takes_fp8_input", None)
            dense = x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
            if (
                takes is not None
                and dense
                and self.weight.dtype == x.dtype
                and takes(fp8_consumer, x)
            ):
                quantized, residual = rms_norm_fp8(x, self.weight, self.eps, residual)
                return quantized if residual is None else (quantized, residual)
            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        ops = cpu_ops(x)
        if ops is not None and x.is_contiguous() and self.weight.dtype == x.dtype:
            # One C++ op for the add and the norm, in place like the CUDA kernel.
            if residual is None:
                return ops.rms_norm(x, None, self.weight, self.eps)
            if residual.is_contiguous() and residual.dtype == x.dtype:
                return ops.rms_norm(x, residual, self.weight, self.eps), residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
