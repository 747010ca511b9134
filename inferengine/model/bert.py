"""Encoder-only BERT and XLM-RoBERTa (BertModel, XLMRobertaModel) for embeddings: bidirectional
attention through the paged backends (non-causal spec), post-LayerNorm blocks, absolute positions.

Runs only as a pooling model, one prompt per step (`PoolingParams.bidirectional`: never chunked,
no prefix hits), on the CPU and torch backends; single-sequence token types (all zero).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inferengine.attention.layer import Attention
from inferengine.attention.metadata import AttentionMetadata
from inferengine.errors import ConfigError, ModelLoadError
from inferengine.model.llama import ModelInit
from inferengine.model.weights import default_weight_loader

NON_CAUSAL_BACKENDS = ("cpu", "torch")
_PREFIXES = ("bert.", "roberta.", "model.")
_UNUSED = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids")


class BertLayer(nn.Module):
    def __init__(self, c: dict[str, Any], backend: Any):
        super().__init__()
        hidden, heads = c["hidden_size"], c["num_attention_heads"]
        self.head_dim = hidden // heads
        eps = c.get("layer_norm_eps", 1e-12)
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Linear(hidden, c["intermediate_size"])
        self.output = nn.Linear(c["intermediate_size"], hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=eps)
        self.attn = Attention(backend, heads, heads, self.head_dim, self.head_dim**-0.5)
        self.attn.spec = dataclasses.replace(self.attn.spec, causal=False)
        act = c.get("hidden_act", "gelu")
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"BERT hidden_act {act!r} is not built (gelu is).")
        self.approximate = "none" if act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata):
        a = self.attn(self.query(x), self.key(x), self.value(x), kv_cache, md)
        x = self.attn_norm(x + self.attn_out(a))
        h = F.gelu(self.intermediate(x), approximate=self.approximate)
        return self.out_norm(x + self.output(h))


class BertModel(nn.Module):
    position_offset = 0  # XLM-RoBERTa counts positions from padding_idx + 1
    scores = False  # a cross-encoder's classification head (XLMRobertaForSequenceClassification)

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        if init.attn_backend.name not in NON_CAUSAL_BACKENDS:
            raise ConfigError(
                f"encoder-only models need non-causal attention, built in the "
                f"{' and '.join(NON_CAUSAL_BACKENDS)} backends only (not {init.attn_backend.name})."
            )
        if init.quant_config is not None:
            raise ConfigError("encoder-only models run unquantized.")
        if c.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError("BERT with relative position embeddings is not built.")
        hidden = c["hidden_size"]
        self.vocab_size = c["vocab_size"]
        self.word_embeddings = nn.Embedding(c["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(c["max_position_embeddings"], hidden)
        self.token_type_embeddings = nn.Embedding(c.get("type_vocab_size", 2), hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=c.get("layer_norm_eps", 1e-12))
        self.layers = nn.ModuleList(
            BertLayer(c, init.attn_backend) for _ in range(c["num_hidden_layers"])
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        intermediate: Any = None,
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        x = x + self.position_embeddings(positions + self.position_offset)
        x = self.embed_norm(x + self.token_type_embeddings.weight[0])
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, kv_cache, metadata)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """No LM head: a pooling request's one (dropped) token is drawn from zeros."""
        return hidden.new_zeros(hidden.shape[0], self.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            for prefix in _PREFIXES:
                name = name.removeprefix(prefix)
            if name.startswith(_UNUSED) or (name.startswith("classifier.") and not self.scores):
                continue
            target = _our_name(name)
            if target not in params:
                raise ModelLoadError(f"checkpoint tensor {name} has no place in the model")
            default_weight_loader(params[target], tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")


class XLMRobertaModel(BertModel):
    def __init__(self, init: ModelInit):
        super().__init__(init)
        self.position_offset = int(init.hf_config.get("pad_token_id", 1)) + 1


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """A cross-encoder reranker (bge-reranker-v2-m3): one logit from the CLS row, dense + tanh
    then a projection, as RobertaClassificationHead; the score is its sigmoid."""

    scores = True

    def __init__(self, init: ModelInit):
        super().__init__(init)
        c = init.hf_config
        if c.get("num_labels", len(c.get("id2label") or {0: 0})) != 1:
            raise ConfigError(
                "cross-encoders with one label (a relevance logit) are built, not more."
            )
        hidden = c["hidden_size"]
        self.classifier_dense = nn.Linear(hidden, hidden)
        self.classifier_out = nn.Linear(hidden, 1)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.classifier_out(torch.tanh(self.classifier_dense(cls_rows)))


_RENAMES = (
    ("encoder.layer.", "layers."),
    (".attention.self.query.", ".query."),
    (".attention.self.key.", ".key."),
    (".attention.self.value.", ".value."),
    (".attention.output.dense.", ".attn_out."),
    (".attention.output.LayerNorm.", ".attn_norm."),
    (".intermediate.dense.", ".intermediate."),
    (".output.dense.", ".output."),
    (".output.LayerNorm.", ".out_norm."),
    ("classifier.dense.", "classifier_dense."),
    ("classifier.out_proj.", "classifier_out."),
)


def _our_name(name: str) -> str:
    name = name.replace("embeddings.LayerNorm.", "embed_norm.").removeprefix("embeddings.")
    for hf, ours in _RENAMES:
        name = name.replace(hf, ours)
    return name.replace(".gamma", ".weight").replace(".beta", ".bias")
