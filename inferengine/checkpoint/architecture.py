"""Which code runs a checkpoint: `config.json`'s `architectures[0]` has a native implementation
(one of our model classes) or runs through Transformers' own modeling code on our paged attention
(the fallback, `model/transformers_fallback.py`), as `--model-impl` says: auto (native when there
is one, else Transformers), native or transformers.

Names only, decided before anything loads (`EngineArgs`): `model/registry.py` maps each native
name to its class, and its `register_model` adds a name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inferengine.errors import ModelLoadError

# The architectures with a built-in class (model/registry.py says which class runs each).
BUILTIN_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
        "Phi3ForCausalLM",
        "BertModel",  # encoders: pooling only (checkpoint/pooling.py)
        "LlamaModel",  # headless decoders: pooling only (model/headless.py)
        "MistralModel",
        "Qwen2Model",
        "Qwen3Model",
        "XLMRobertaModel",
        "XLMRobertaForSequenceClassification",
    }
)
_registered: set[str] = set()  # added by register_model (model/registry.py keeps the classes)

# Keys the engine reads from config.json that some Transformers configs spell otherwise (GPT-2's
# n_layer, n_head, ...): filled in from the config object when config.json lacks them.
_STANDARD_KEYS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "max_position_embeddings",
)


def register_architecture(name: str) -> None:
    """Count `name` as native (`model/registry.register_model`, which keeps its class)."""
    _registered.add(name)


def supported_architectures() -> list[str]:
    return sorted(BUILTIN_ARCHITECTURES | _registered)


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
    native = name in _registered or name in BUILTIN_ARCHITECTURES
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


def transformers_support(name: str) -> str | None:
    """None when Transformers can run architecture `name` on our attention; else a sentence
    saying why not."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    version = transformers.__version__
    if not hasattr(transformers, "AttentionInterface"):
        return f"Transformers {version} has no attention interface; install transformers>=4.48."
    if name not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        if hasattr(transformers, name):
            return f"Transformers' {name} is not a causal language model."
        return (
            f"Transformers {version} has no architecture {name!r} either (a newer release may; "
            "models with remote code are not loaded)."
        )
    try:
        cls = getattr(transformers, name)
    except Exception as e:  # a modeling module whose own dependencies are missing
        return f"Transformers' {name} cannot be imported here ({e})."
    if not cls.is_backend_compatible():
        return (
            f"Transformers' {name} does not take a custom attention implementation, so it cannot "
            "run on the paged KV cache."
        )
    return None


def transformers_config(hf_config: dict[str, Any]):
    """Transformers' config object for `hf_config`, read as `from_pretrained` reads it."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[hf_config["model_type"]].from_dict(dict(hf_config))
    except (KeyError, ValueError) as e:
        raise ModelLoadError(
            f"Transformers cannot read this config.json ({e}); is `model_type` right?"
        ) from e


def fallback_hf_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """`hf_config` plus the standard keys it lacks, read through Transformers' config class."""
    config = transformers_config(hf_config)
    filled = dict(hf_config)
    for key in _STANDARD_KEYS:
        value = getattr(config, key, None)
        if key not in filled and value is not None:
            filled[key] = value
    return filled
