"""A multimodal checkpoint's config read as its text model's: Gemma 3's
`Gemma3ForConditionalGeneration` (4B, 12B, 27B), served as text-only Gemma 3
(`model/gemma3_mm.py`).

The config nests the decoder's settings under `text_config` (beside `vision_config`);
`text_only_config` lifts them to the top level when config.json is read (`resolve.py`), so every
reader of the config (model, KV cache sizing, context length, EOS) sees a plain `gemma3_text`
config. Hub configs leave most text settings at their defaults, which are filled in as
Transformers' `Gemma3TextConfig` would.
"""

from __future__ import annotations

from typing import Any

# Transformers' Gemma3TextConfig defaults, for keys a hub `text_config` leaves out.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}

# Top-level keys of the multimodal config that hold for the text model too: the EOS list there
# includes <end_of_turn>, which the nested text config lacks, and Transformers ties the head by
# the top-level flag.
_OUTER_KEYS = (
    "architectures",
    "tie_word_embeddings",
    "eos_token_id",
    "bos_token_id",
    "pad_token_id",
    "torch_dtype",
    "dtype",
    "quantization_config",
)


def text_only_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """A `Gemma3ForConditionalGeneration` config flattened to its text model's settings (the
    architecture name kept, so the registry picks `model/gemma3_mm.py`'s class); other configs
    unchanged."""
    if (hf_config.get("architectures") or [None])[0] != "Gemma3ForConditionalGeneration":
        return hf_config
    text = dict(hf_config.get("text_config") or {})
    flat = {**GEMMA3_TEXT_DEFAULTS, **text}
    for key in _OUTER_KEYS:
        if hf_config.get(key) is not None:
            flat[key] = hf_config[key]
    flat["model_type"] = text.get("model_type", "gemma3_text")
    return flat
