"""Architecture registry: `config.json`'s `architectures[0]` picks the model class.

`register_model(name, cls)` adds an architecture without touching InferEngine's code; `cls` is
built as `cls(ModelInit)` and must offer `forward`, `compute_logits` and `load_weights` like
`LlamaForCausalLM` (to run quantized, it hands `ModelInit.quant_config` and each layer's name
to its linear layers). An architecture without a native class runs through Transformers' own
modeling code on our paged attention (`model/transformers_fallback.py`), as `--model-impl`
says: auto (native when there is one, else Transformers), native or transformers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from inferengine.errors import ModelLoadError

# Built-in architectures, imported on first use: name -> "module:Class".
_BUILTIN = {
    "LlamaForCausalLM": "inferengine.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "inferengine.model.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "inferengine.model.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "inferengine.model.llama:Qwen3ForCausalLM",
    "Gemma2ForCausalLM": "inferengine.model.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "inferengine.model.gemma:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "inferengine.model.gemma3_mm:Gemma3ForConditionalGeneration",
    "MixtralForCausalLM": "inferengine.model.moe:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "inferengine.model.moe:Qwen3MoeForCausalLM",
    "Phi3ForCausalLM": "inferengine.model.llama:Phi3ForCausalLM",
}
_registered: dict[str, type] = {}


def register_model(name: str, cls: type) -> None:
    """Serve `config.json` files whose `architectures[0]` is `name` with `cls`."""
    _registered[name] = cls


def supported_architectures() -> list[str]:
    return sorted(set(_BUILTIN) | set(_registered))


@dataclass(frozen=True)
class Implementation:
    """Which code runs an architecture, and why (logged once at start-up)."""

    architecture: str
    native: bool  # False: Transformers' modeling code on our paged attention
    reason: str

    def describe(self) -> str:
        kind = "native" if self.native else "Transformers fallback"
        return f"model implementation for {self.architecture}: {kind} ({self.reason})"


def choose_implementation(hf_config: dict[str, Any], model_impl: str = "auto") -> Implementation:
    """Pick native or Transformers code for `hf_config`'s architecture, per `--model-impl`."""
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise ModelLoadError(
            "config.json has no `architectures` entry, so the model class is unknown. Add e.g. "
            '"architectures": ["LlamaForCausalLM"]. Supported: '
            + ", ".join(supported_architectures())
        )
    name = architectures[0]
    native = name in _registered or name in _BUILTIN
    if model_impl == "native":
        if not native:
            raise ModelLoadError(
                f"--model-impl native: architecture {name!r} has no native implementation "
                f"(native: {', '.join(supported_architectures())}). Use --model-impl auto or "
                "transformers to run it through Transformers' modeling code."
            )
        return Implementation(name, True, "--model-impl native")
    if model_impl == "auto" and native:
        return Implementation(name, True, "registered natively; --model-impl auto")
    from inferengine.model.transformers_fallback import transformers_support

    problem = transformers_support(name)
    if problem is None:
        reason = (
            "--model-impl transformers"
            if model_impl == "transformers"
            else "no native implementation, Transformers has one; --model-impl auto"
        )
        return Implementation(name, False, reason)
    if model_impl == "transformers":
        raise ModelLoadError(f"--model-impl transformers: {problem}")
    raise ModelLoadError(
        f"architecture {name!r} is not supported: no native implementation "
        f"({', '.join(supported_architectures())}), and {problem} "
        "To add one, call inferengine.register_model(name, cls)."
    )


def resolve_model_class(hf_config: dict[str, Any], model_impl: str = "auto") -> type:
    impl = choose_implementation(hf_config, model_impl)
    name = impl.architecture
    if not impl.native:
        from inferengine.model.transformers_fallback import TransformersForCausalLM

        return TransformersForCausalLM
    if name in _registered:
        return _registered[name]
    module, cls = _BUILTIN[name].split(":")
    return getattr(importlib.import_module(module), cls)
