"""FP8 linear y = x (W·diag(s))ᵀ (+ b): weight and per-token activation quantization, the
per-shape choice between the W8A16 skinny kernel and `torch._scaled_mm`, and torch references.

Weights are float8_e4m3fn [N, K] with one float32 scale per output row. On CUDA, decode-sized
inputs take the W8A16 skinny GEMM (x stays 16-bit, W is dequantized in registers); larger ones
are quantized per token and multiplied by `torch._scaled_mm` with row-wise scales; the RMSNorm
before a linear may have quantized them already (`Fp8Input`, `norm.rms_norm_fp8`). Elsewhere
(the CPU, GPUs before Ada) W is dequantized to x's dtype and multiplied by `F.linear`: a
correctness path.
Hot path: no host syncs, launch shapes from tensor shapes only (CUDA-graph safe).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferengine import envs
from inferengine.kernels.triton_utils import pdl_launch, triton_available

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros instead of dividing by zero

# Largest M at which the W8A16 skinny kernel beats per-token quantization + `torch._scaled_mm`,
# keyed by (N, K), from `benchmarks/skinny_gemm.py --fp8`. Empty: on an H100 80GB HBM3 the
# kernel won at every M up to 32 on all four Qwen2.5-7B projections (20261125T031132Z-skinny-
# gemm), which is `DEFAULT_W8A16_MAX_M`, the skinny kernel's whole range.
W8A16_MAX_M: dict[tuple[int, int], int] = {}
DEFAULT_W8A16_MAX_M = 32
_QUANT_BLOCK = 1024


@dataclass(frozen=True, slots=True)
class Fp8Input:
    """A linear's input quantized per token where it was made (the RMSNorm before the linear):
    q [M, K] float8 and scale [M, 1] float32 for the 16-bit tensor of `shape` and `dtype`."""

    q: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    def dequantize(self) -> torch.Tensor:
        """The 16-bit tensor these FP8 values stand for (the fallback where `_scaled_mm` cannot
        take them)."""
        return (self.q.float() * self.scale).to(self.dtype).view(self.shape)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of w [N, K]: (float8 [N, K], float32 scale [N]) with
    w ≈ q * scale[:, None]; each row's largest magnitude maps to ±448."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q [N, K] float8 with float32 scale [N] (or [N, 1]) -> [N, K] in `dtype`."""
    return (q.float() * scale.reshape(-1, 1)).to(dtype)


def per_token_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scale [M, 1]), one scale per row (token)."""
    q, scale = quantize_rows(x)
    return q, scale.unsqueeze(1)


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`per_token_quant_ref` in one Triton launch on CUDA (or in Triton's CPU interpreter),
    else the reference."""
    if not (x.is_cuda or envs.triton_interpret()) or not triton_available() or x.shape[0] == 0:
        return per_token_quant_ref(x)
    from inferengine.kernels.fp8_kernels import per_token_quant_kernel

    m, k = x.shape
    assert x.stride(1) == 1, "x [M, K] with K dense"
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    per_token_quant_kernel[(m,)](
        x, q, scale, k, x.stride(0), q.stride(0),
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=_QUANT_BLOCK, num_warps=4, **pdl_launch(x),
    )  # fmt: skip
    return q, scale


@functools.cache
def _fp8_capable(device_index: int) -> bool:
    """FP8 tensor cores and Triton's e4m3 conversions: compute capability 8.9 (Ada) or later."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def scaled_mm_supported(x: torch.Tensor | Fp8Input, weight: torch.Tensor) -> bool:
    """Whether `scaled_mm_linear` runs: CUDA with FP8 tensor cores, 16-bit x, and K and N
    multiples of 16 (cuBLASLt's rule for FP8)."""
    n, k = weight.shape
    device = x.q.device if isinstance(x, Fp8Input) else x.device
    return (
        device.type == "cuda"
        and x.dtype in (torch.bfloat16, torch.float16)
        and n % 16 == 0
        and k % 16 == 0
        and _fp8_capable(device.index or 0)
    )


def scaled_mm_linear(
    x: torch.Tensor | Fp8Input,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8: x quantized per token (unless it comes quantized), then `torch._scaled_mm` with
    row-wise scales (scale_a [M, 1], scale_b [1, N]; W [N, K] passed transposed, i.e.
    column-major as cuBLASLt wants). Row-wise scaling writes bf16 only: an fp16 x gets its
    result cast back."""
    n, k = weight.shape
    if isinstance(x, Fp8Input):
        xq, x_scale, shape, dtype = x.q, x.scale, x.shape, x.dtype
    else:
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        xq, x_scale = per_token_quant(x2)
        shape, dtype = x.shape, x.dtype
    fused_bias = bias if bias is not None and bias.dtype == torch.bfloat16 else None
    y = torch._scaled_mm(
        xq,
        weight.t(),
        scale_a=x_scale,
        scale_b=weight_scale.view(1, n),
        bias=fused_bias,
        out_dtype=torch.bfloat16,
    )
    if bias is not None and fused_bias is None:
        y = y + bias.to(y.dtype)
    return y.to(dtype).view(*shape[:-1], n)


def use_w8a16(m: int, n: int, k: int) -> bool:
    return m <= W8A16_MAX_M.get((n, k), DEFAULT_W8A16_MAX_M)


def _path(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which way `fp8_linear` multiplies this x: "w8a16" (the skinny kernel, decode-sized M),
    "scaled_mm" (x quantized per token, `torch._scaled_mm`) or "dequantize" (`F.linear`)."""
    n, k = weight.shape
    m = x.numel() // max(1, k)
    if x.is_cuda and m > 0 and _fp8_capable(x.device.index or 0):
        from inferengine.kernels import skinny_gemm as sg

        if use_w8a16(m, n, k) and sg.supports(x, weight):
            return "w8a16"
        if scaled_mm_supported(x, weight):
            return "scaled_mm"
    return "dequantize"


def takes_fp8_input(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `fp8_linear(x, weight, ...)` would quantize x per token for `torch._scaled_mm`:
    then the RMSNorm that makes x may as well hand it over quantized (`Fp8Input`)."""
    return _path(x, weight) == "scaled_mm"


def fp8_linear(
    x: torch.Tensor | Fp8Input,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] float8 · weight_scale [N])ᵀ (+ bias) -> [..., N] in x's dtype,
    by the fastest path this device and shape have (module docstring). An `Fp8Input` goes to
    `torch._scaled_mm` as it is (it was made because `takes_fp8_input` said so); where that
    cannot run, it is dequantized and takes the usual path."""
    if isinstance(x, Fp8Input):
        if scaled_mm_supported(x, weight):
            return scaled_mm_linear(x, weight, weight_scale, bias)
        x = x.dequantize()
    path = _path(x, weight)
    if path == "w8a16":
        from inferengine.kernels import skinny_gemm as sg

        return sg.skinny_linear(x, weight, bias, weight_scale=weight_scale)
    if path == "scaled_mm":
        return scaled_mm_linear(x, weight, weight_scale, bias)
    return F.linear(x, dequantize_rows(weight, weight_scale, x.dtype), bias)


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    quantize_input: bool = False,
) -> torch.Tensor:
    """Torch reference in float32, rounded once to x's dtype; `quantize_input` rounds x per
    token to FP8 first, as `scaled_mm_linear` does (W8A8), else x stays exact (W8A16)."""
    k = weight.shape[1]
    x2 = x.reshape(-1, k)
    if quantize_input:
        xq, x_scale = per_token_quant_ref(x2)
        x32 = xq.float() * x_scale
    else:
        x32 = x2.float()
    y = F.linear(x32, dequantize_rows(weight, weight_scale), None if bias is None else bias.float())
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
