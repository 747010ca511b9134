"""SiLU-gated MLP activation, silu(gate) * up (Triton + torch reference with HF's rounding)."""

import torch

from inferengine.kernels.triton_utils import pdl_launch

_BLOCK = 1024


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2*I] (gate then up) -> [..., I]."""
    from inferengine.kernels.fused_kernels import silu_and_mul_kernel

    intermediate_size = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], intermediate_size), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, intermediate_size)
    if x2.shape[0] > 0:
        grid = (x2.shape[0], -(-intermediate_size // _BLOCK))
        silu_and_mul_kernel[grid](
            x2,
            out2,
            intermediate_size,
            x2.stride(0),
            out2.stride(0),
            BLOCK=_BLOCK,
            num_warps=4,
            **pdl_launch(x2),
        )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of `silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
