"""Gemma 3 multimodal checkpoints (`Gemma3ForConditionalGeneration`: 4B, 12B, 27B) served as
text-only Gemma 3.

The config nests the decoder's settings under `text_config` (beside `vision_config`);
`text_only_config` lifts them to the top level when config.json is read, so every reader of the
config (model, KV cache sizing, context length, EOS) sees a plain `gemma3_text` config. Hub
configs leave most text settings at their defaults, which are filled in as Transformers'
`Gemma3TextConfig` would. Weights are named `language_model.model.*` (the released checkpoints,
and what Transformers 5's `save_pretrained` still writes) or `model.language_model.*` with a
top-level `lm_head` (Transformers' in-memory layout, found in some re-saved checkpoints); the
vision tower and the multimodal projector are not read at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from inferengine.logger import init_logger
from inferengine.model.gemma import Gemma3ForCausalLM
from inferengine.model.llama import ModelInit

logger = init_logger(__name__)

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

# Checkpoint prefixes of the text decoder (old layout, new layout) and of the parts we skip.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def text_only_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """A `Gemma3ForConditionalGeneration` config flattened to its text model's settings (the
    architecture name kept, so the registry picks the class below); other configs unchanged."""
    if (hf_config.get("architectures") or [None])[0] != "Gemma3ForConditionalGeneration":
        return hf_config
    text = dict(hf_config.get("text_config") or {})
    flat = {**GEMMA3_TEXT_DEFAULTS, **text}
    for key in _OUTER_KEYS:
        if hf_config.get(key) is not None:
            flat[key] = hf_config[key]
    flat["model_type"] = text.get("model_type", "gemma3_text")
    return flat


def text_weight_name(name: str) -> str | None:
    """Our (Gemma3ForCausalLM) name for a multimodal checkpoint tensor; None for vision ones."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, ours in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return name  # lm_head.weight in the Transformers 5 layout


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text decoder of a multimodal Gemma 3 checkpoint; images are not supported."""

    def __init__(self, init: ModelInit):
        super().__init__(init)
        # Vision tensors left out, as the reader's filter or our loader saw them.
        self._skipped: set[str] = set()

    def wants_weight(self, name: str) -> bool:
        ours = text_weight_name(name)
        if ours is None:
            self._skipped.add(name)
            return False
        return super().wants_weight(ours)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def text_weights():
            for name, tensor in weights:
                ours = text_weight_name(name)
                if ours is None:
                    self._skipped.add(name)
                else:
                    yield ours, tensor

        super().load_weights(text_weights())
        if self._skipped:
            logger.info(
                "Gemma 3 served as text only: skipped %d vision tower and projector tensors",
                len(self._skipped),
            )
