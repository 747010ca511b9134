"""Architecture registry: `config.json`'s `architectures[0]` picks the model class.

`register_model(name, cls)` adds an architecture without touching InferEngine's code; `cls` is
built as `cls(ModelInit)` and must offer `forward`, `compute_logits` and `load_weights` like
`LlamaForCausalLM` (to run quantized, it hands `ModelInit.quant_config` and each layer's name
to its linear layers). An architecture without a native class runs through Transformers' own
modeling code on our paged attention (`model/transformers_fallback.py`), as `--model-impl`
says: auto (native when there is one, else Transformers), native or transformers
(`checkpoint/architecture.py` decides which, from the names alone).
"""

from __future__ import annotations

import importlib
from typing import Any

from inferengine.checkpoint.architecture import choose_implementation, register_architecture

# Built-in architectures, imported on first use: name -> "module:Class" (the names are
# checkpoint/architecture.py's BUILTIN_ARCHITECTURES).
_BUILTIN = {
    "LlamaForCausalLM": "inferengine.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "inferengine.model.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "inferengine.model.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "inferengine.model.llama:Qwen3ForCausalLM",
    "BertModel": "inferengine.model.bert:BertModel",
    "LlamaModel": "inferengine.model.headless:LlamaModel",
    "MistralModel": "inferengine.model.headless:MistralModel",
    "Qwen2Model": "inferengine.model.headless:Qwen2Model",
    "Qwen3Model": "inferengine.model.headless:Qwen3Model",
    "XLMRobertaModel": "inferengine.model.bert:XLMRobertaModel",
    "XLMRobertaForSequenceClassification": "inferengine.model.bert:XLMRobertaForSequenceClassification",
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
    register_architecture(name)


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
