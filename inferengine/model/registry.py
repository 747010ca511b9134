"""Architecture registry: `config.json`'s `architectures[0]` picks the model class.

`register_model(name, cls)` adds an architecture without touching InferEngine's code; `cls` is
built as `cls(ModelInit)` and must offer `forward`, `compute_logits` and `load_weights` like
`LlamaForCausalLM`.
"""

from __future__ import annotations

import importlib
from typing import Any

from inferengine.errors import ModelLoadError

# Built-in architectures, imported on first use: name -> "module:Class".
_BUILTIN = {
    "LlamaForCausalLM": "inferengine.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "inferengine.model.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "inferengine.model.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "inferengine.model.llama:Qwen3ForCausalLM",
}
_registered: dict[str, type] = {}


def register_model(name: str, cls: type) -> None:
    """Serve `config.json` files whose `architectures[0]` is `name` with `cls`."""
    _registered[name] = cls


def supported_architectures() -> list[str]:
    return sorted(set(_BUILTIN) | set(_registered))


def resolve_model_class(hf_config: dict[str, Any]) -> type:
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise ModelLoadError(
            "config.json has no `architectures` entry, so the model class is unknown. Add e.g. "
            '"architectures": ["LlamaForCausalLM"]. Supported: '
            + ", ".join(supported_architectures())
        )
    name = architectures[0]
    if name in _registered:
        return _registered[name]
    if name in _BUILTIN:
        module, cls = _BUILTIN[name].split(":")
        return getattr(importlib.import_module(module), cls)
    raise ModelLoadError(
        f"architecture {name!r} is not supported. Supported: {', '.join(supported_architectures())}. "
        "To add one, call inferengine.register_model(name, cls)."
    )
