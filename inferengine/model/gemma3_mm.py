"""Gemma 3 multimodal checkpoints (`Gemma3ForConditionalGeneration`: 4B, 12B, 27B) served as
text-only Gemma 3.

The config nests the decoder's settings under `text_config` (beside `vision_config`);
`checkpoint/text_config.py` lifts them to the top level when config.json is read, so every
reader of the config (this class included) sees a plain `gemma3_text` config. Weights are named
`language_model.model.*` (the released checkpoints, and what Transformers 5's `save_pretrained`
still writes) or `model.language_model.*` with a top-level `lm_head` (Transformers' in-memory
layout, found in some re-saved checkpoints); the vision tower and the multimodal projector are
not read at all.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from inferengine.logger import init_logger
from inferengine.model.gemma import Gemma3ForCausalLM
from inferengine.model.llama import ModelInit

logger = init_logger(__name__)

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
