"""InferEngine: a readable LLM inference and serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inferengine.version import __version__

__all__ = [
    "LLM",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
    "register_model",
]

if TYPE_CHECKING:
    from inferengine.entrypoints.llm import LLM
    from inferengine.model.registry import register_model
    from inferengine.outputs import RequestOutput
    from inferengine.sampling_params import SamplingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "inferengine.entrypoints.llm",
    "RequestOutput": "inferengine.outputs",
    "SamplingParams": "inferengine.sampling_params",
    "StructuredOutputsParams": "inferengine.sampling_params",
    "register_model": "inferengine.model.registry",
}


def __getattr__(name: str) -> Any:
    """Import heavy parts (torch, transformers) only when they are used."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'inferengine' has no attribute {name!r}")
