"""Headless decoders (`LlamaModel`, `MistralModel`, `Qwen2Model`, `Qwen3Model`): checkpoints
saved without an LM head, as embedders such as e5-mistral are; pooling only.

They run on the `*ForCausalLM` classes with the head tied to the embeddings (it only draws a
pooling request's dropped token) and the checkpoint's names under `model.`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from inferengine.model.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    ModelInit,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)


def _tied(init: ModelInit) -> ModelInit:
    return dataclasses.replace(init, hf_config={**init.hf_config, "tie_word_embeddings": True})


def _under_model(weights: Iterable[tuple[str, torch.Tensor]]):
    for name, tensor in weights:
        yield (name if name.startswith("model.") else f"model.{name}"), tensor


class LlamaModel(LlamaForCausalLM):
    def __init__(self, init: ModelInit):
        super().__init__(_tied(init))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_under_model(weights))


class MistralModel(LlamaModel, MistralForCausalLM):
    pass


class Qwen2Model(LlamaModel, Qwen2ForCausalLM):
    pass


class Qwen3Model(LlamaModel, Qwen3ForCausalLM):
    pass
