"""Picks the attention backend for a device: `auto`, `torch`, `triton` or `flex`."""

from __future__ import annotations

from inferengine.attention.backends.base import AttentionBackend
from inferengine.config import ATTENTION_BACKENDS
from inferengine.errors import ConfigError
from inferengine.logger import init_logger

logger = init_logger(__name__)


def _triton_usable(device: str) -> bool:
    from inferengine.kernels.triton_utils import triton_available

    return device == "cuda" and triton_available()


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}."
        )
    if name == "auto":
        name = "triton" if _triton_usable(device) else "torch"
    if name == "torch":
        from inferengine.attention.backends.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from inferengine.attention.backends.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from inferengine.attention.backends.flex import FlexAttentionBackend

    return FlexAttentionBackend()
