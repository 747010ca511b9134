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


def _torch() -> AttentionBackend:
    from inferengine.attention.backends.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()


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


def usable_backends(device: str) -> dict[str, Callable[[], AttentionBackend]]:
    """Constructors of the backends that can run on `device`, preferred first."""
    from inferengine.attention.backends.flex import flex_available

    backends: dict[str, Callable[[], AttentionBackend]] = {}
    if _triton_usable(device):
        backends["triton"] = _triton
    backends["torch"] = _torch
    if flex_available():
        backends["flex"] = _flex
    return backends


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}."
        )
    if name == "auto":
        name = "triton" if _triton_usable(device) else "torch"
    if name == "triton" and not _triton_usable(device):
        raise ConfigError(
            f"--attention-backend triton needs a CUDA device and triton; this engine runs on "
            f"{device}. Use --attention-backend auto."
        )
    return {"torch": _torch, "triton": _triton, "flex": _flex}[name]()


def select_attention_backend(
    name: str, benchmark: bool, device: torch.device, shape: AttentionShape
) -> tuple[AttentionBackend, dict[str, float]]:
    """The backend to build the model with, and the benchmark's timings (ms) if one ran."""
    if not benchmark:
        return get_attention_backend(name, device.type), {}
    if name != "auto":
        logger.warning(
            "--attention-backend %s given: it wins over --attention-backend-benchmark", name
        )
        return get_attention_backend(name, device.type), {}
    choice = choose_backend(shape, device, usable_backends(device.type), envs.cache_dir())
    backend = get_attention_backend(choice.backend, device.type)
    if device.type == "cuda" and not backend.cuda_graph_safe:
        logger.warning(
            "attention benchmark chose %s: decode steps run without CUDA graphs", backend.name
        )
    return backend, choice.timings_ms
