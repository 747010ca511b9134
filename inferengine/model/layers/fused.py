"""Whether layers on a CUDA tensor use the fused Triton kernels (decided once per process)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _triton_on_cuda() -> bool:
    from inferengine.kernels.triton_utils import triton_installed

    return triton_installed() and torch.cuda.is_available()


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Fused kernels run on CUDA tensors; CPU tensors keep the Transformers-exact torch math."""
    return x.is_cuda and _triton_on_cuda()
