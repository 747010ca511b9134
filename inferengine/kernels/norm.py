"""RMSNorm and fused residual-add + RMSNorm (Triton + torch references with Hugging Face's math),
also with the result quantized per token to FP8 for the linear after it."""

import torch

from inferengine.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Input
from inferengine.kernels.triton_utils import next_power_of_2, pdl_launch


def _launch(x, residual, weight, out, eps: float) -> None:
    from inferengine.kernels.fused_kernels import rms_norm_kernel

    hidden_size = x.shape[-1]
    rows = x.numel() // hidden_size
    if rows == 0:
        return
    block = next_power_of_2(hidden_size)
    rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        hidden_size,
        eps,
        x.stride(-2) if x.dim() > 1 else hidden_size,
        residual.stride(-2) if residual is not None and residual.dim() > 1 else hidden_size,
        out.stride(-2) if out.dim() > 1 else hidden_size,
        ADD_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
        **pdl_launch(x),
    )


def _heads(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """RMSNorm of every head of a [tokens, heads, head_dim] view (q/k norm) without copying it
    to rows first: a split of the fused qkv output has no uniform row stride."""
    from inferengine.kernels.fused_kernels import head_rms_norm_kernel

    tokens, heads, head_dim = x.shape
    if tokens == 0 or heads == 0:
        return
    block_d = next_power_of_2(head_dim)
    block_h = min(next_power_of_2(heads), max(1, 2048 // block_d))
    head_rms_norm_kernel[(tokens, -(-heads // block_h))](
        x,
        weight,
        out,
        heads,
        head_dim,
        eps,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1,
        **pdl_launch(x),
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A [rows, hidden] view (or copy) whose rows are evenly strided and whose last dim is dense."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) over the last dim, as HF computes it (float32 inside; the result
    takes the promoted dtype of x and weight, like HF). A 3-D x (tokens, heads, head_dim) with
    a dense last dim is read where it lies, per head, whatever its other strides."""
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if x.dim() == 3 and x.stride(-1) == 1:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        _heads(x, weight, eps, out)
        return out
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    _launch(x2, None, weight, out, eps)
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x, then x = weight * rmsnorm(residual). Returns (x, residual).
    Both must be row-strided with a dense last dim (e.g. contiguous)."""
    assert x.shape == residual.shape and x.stride(-1) == 1 and residual.stride(-1) == 1
    x2 = x.view(-1, x.shape[-1]) if x.dim() != 2 else x
    r2 = residual.view(-1, residual.shape[-1]) if residual.dim() != 2 else residual
    _launch(x2, r2, weight, x2, eps)
    return x, residual


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[Fp8Input, torch.Tensor | None]:
    """`rms_norm(x, ...)`, or with a residual `fused_add_rms_norm(x, residual, ...)` (residual
    updated in place; x is not written), handed on quantized per token as `per_token_quant`
    would quantize it: `(Fp8Input, residual)`. x and weight share a 16-bit dtype."""
    from inferengine.kernels.fp8_kernels import rms_norm_fp8_kernel

    assert weight.dtype == x.dtype and x.stride(-1) == 1
    hidden_size = x.shape[-1]
    x2 = x.view(-1, hidden_size) if x.dim() != 2 else x
    r2 = None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        r2 = residual.view(-1, hidden_size) if residual.dim() != 2 else residual
    rows = x2.shape[0]
    q = torch.empty((rows, hidden_size), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = next_power_of_2(hidden_size)
        rms_norm_fp8_kernel[(rows,)](
            x2, r2 if r2 is not None else x2, weight, q, scale, hidden_size, eps, x2.stride(0),
            r2.stride(0) if r2 is not None else hidden_size, q.stride(0),
            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, ADD_RESIDUAL=r2 is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 256)), **pdl_launch(x),
        )  # fmt: skip
    return Fp8Input(q, scale, x.shape, x.dtype), residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama/Qwen2 RMSNorm."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `fused_add_rms_norm`, in place like it."""
    residual.add_(x)
    x.copy_(rms_norm_ref(residual, weight, eps))
    return x, residual
