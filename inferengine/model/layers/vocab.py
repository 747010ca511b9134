"""Token embedding and LM head, split by vocabulary rows across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inferengine.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tp_all_gather,
    tp_all_reduce,
)
from inferengine.model.layers.linear import linear, shape_of


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        tp = get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp)  # the last rank's shard is padded
        self.start = get_tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        """Copy this rank's vocabulary rows (a torch tensor or an unread safetensors slice)."""
        full = shape_of(loaded)
        if full != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"shape mismatch: embedding {(self.vocab_size, param.shape[1])}, checkpoint {full}"
            )
        rows = loaded[self.start : min(self.start + self.shard_size, self.vocab_size)]
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states to logits over the full vocabulary (each rank computes its rows)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)
        logits = tp_all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
