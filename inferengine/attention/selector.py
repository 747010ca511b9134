"""Picks the attention backend for a device: `auto`, `torch`, `triton` or `flex`, or with
`--attention-backend-benchmark` the fastest usable one on the model's shape."""

from __future__ import annotations

from collections.abc import Callable

import torch

from inferengine import envs
from inferengine.attention.autotune import AttentionShape, choose_backend
from inferengine.attention.backends.base import AttentionBackend
from inferengine.config import ATTENTION_BACKENDS
from inferengine.errors import ConfigError
from inferengine.logger import init_logger

logger = init_logger(__name__)


def _triton_usable(device: str) -> bool:
    from inferengine.kernels.triton_utils import triton_available

    return device == "cuda" and triton_available()


def triton_unsupported_reason(shape: AttentionShape) -> str | None:
    """Why the Triton kernels cannot run this model's attention (None: they can). Checked at
    start-up so an unsupported shape takes the torch path, never an error mid-request."""
    from inferengine.kernels.kv_quant import is_fp8
    from inferengine.kernels.paged_attention import supports_head_dim

    if not supports_head_dim(shape.head_dim):
        return f"head dim {shape.head_dim} is above the Triton kernels' 256"
    if is_fp8(shape.cache_dtype) and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            return (
                f"Triton converts fp8 KV pages on compute capability 8.9 or later (Ada, "
                f"Hopper); this GPU is {major}.{minor}"
            )
    return None


def _flex_reads(device: str, shape: AttentionShape | None) -> bool:
    """Flex on CUDA would dequantize the whole fp8 cache in every layer: not offered."""
    from inferengine.kernels.kv_quant import is_fp8

    return not (device == "cuda" and shape is not None and is_fp8(shape.cache_dtype))


def _torch() -> AttentionBackend:
    from inferengine.attention.backends.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()


def _cpu() -> AttentionBackend:
    from inferengine.attention.backends.cpu import CpuAttentionBackend

    return CpuAttentionBackend()


def _triton() -> AttentionBackend:
    from inferengine.attention.backends.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _flex() -> AttentionBackend:
    from inferengine.attention.backends.flex import FlexAttentionBackend, flex_available

    if not flex_available():
        raise ConfigError(
            f"--attention-backend flex needs PyTorch FlexAttention (torch>=2.5); this is torch "
            f"{torch.__version__}. Use --attention-backend auto."
        )
    return FlexAttentionBackend()


def usable_backends(
    device: str, shape: AttentionShape
) -> dict[str, Callable[[], AttentionBackend]]:
    """Constructors of the backends that can run `shape` on `device`, preferred first."""
    from inferengine.attention.backends.flex import flex_available

    backends: dict[str, Callable[[], AttentionBackend]] = {}
    if _triton_usable(device) and triton_unsupported_reason(shape) is None:
        backends["triton"] = _triton
    if device == "cpu":
        backends["cpu"] = _cpu
    backends["torch"] = _torch
    if flex_available() and _flex_reads(device, shape):
        backends["flex"] = _flex
    return backends


def get_attention_backend(
    name: str, device: str, shape: AttentionShape | None = None
) -> AttentionBackend:
    """The backend `name` for `device`; `auto` is Triton on CUDA unless it cannot run
    `shape`, where it falls back to the torch reference (logged), and `cpu` on the CPU."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}."
        )
    why_not = triton_unsupported_reason(shape) if shape is not None else None
    usable = _triton_usable(device)
    if name == "auto":
        name = "triton" if usable and why_not is None else "cpu" if device == "cpu" else "torch"
        if usable and why_not is not None:
            logger.warning("attention: %s, so the torch reference runs it (slower)", why_not)
    if name == "triton" and not usable:
        raise ConfigError(
            f"--attention-backend triton needs a CUDA device and triton; this engine runs on "
            f"{device}. Use --attention-backend auto."
        )
    if name == "triton" and why_not is not None:
        raise ConfigError(
            f"--attention-backend triton cannot run this model: {why_not}. Use "
            "--attention-backend auto (the torch reference) or flex."
        )
    if name == "flex" and not _flex_reads(device, shape):
        raise ConfigError(
            "--attention-backend flex cannot read an fp8 KV cache on CUDA; use "
            "--attention-backend triton or auto, or --kv-cache-dtype auto."
        )
    return {"torch": _torch, "cpu": _cpu, "triton": _triton, "flex": _flex}[name]()


def select_attention_backend(
    name: str, benchmark: bool, device: torch.device, shape: AttentionShape
) -> tuple[AttentionBackend, dict[str, float]]:
    """The backend to build the model with, and the benchmark's timings (ms) if one ran."""
    if not benchmark:
        return get_attention_backend(name, device.type, shape), {}
    if name != "auto":
        logger.warning(
            "--attention-backend %s given: it wins over --attention-backend-benchmark", name
        )
        return get_attention_backend(name, device.type, shape), {}
    backends = usable_backends(device.type, shape)
    choice = choose_backend(shape, device, backends, envs.cache_dir())
    backend = get_attention_backend(choice.backend, device.type, shape)
    if device.type == "cuda" and not backend.cuda_graph_safe:
        logger.warning(
            "attention benchmark chose %s: decode steps run without CUDA graphs", backend.name
        )
    return backend, choice.timings_ms
