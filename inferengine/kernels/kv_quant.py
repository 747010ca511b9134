"""FP8 KV cache: the storage dtypes behind `--kv-cache-dtype`, and quantizing K/V rows to them
and back in torch (the Triton kernels do the same in registers).

A stored element is `clamp(x / scale, ±max)` cast to the fp8 dtype; a read one is
`fp8 · scale`, with one float scale per layer for K and one for V (1.0 unless the checkpoint
carries calibrated ones). A cache in the model's own dtype ignores the scales.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype KV pages are stored in for `--kv-cache-dtype cache_dtype` ("auto": the
    model's)."""
    return model_dtype if cache_dtype == "auto" else CACHE_DTYPES[cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`x` as stored in a cache of `dtype`: scaled and saturated for fp8, else only cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = fp8_max(dtype)
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache elements `x` read back as `dtype` (fp8 values times `scale`)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte-element tensor as uint8, for copies torch does not implement on fp8
    (`index_copy_` on the CPU); other tensors as they are."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
