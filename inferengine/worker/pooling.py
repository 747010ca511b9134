"""Pooling requests in the model runner: the pooled vector of each prompt whose last chunk ran.

A pooling request is prompt-only: each step's final hidden states of its prompt positions fold
into a running sum (MEAN) or the first position (CLS), and the step that computes its last
prompt token emits the vector (LAST reads that token), cut to `dimensions` then normalized.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from inferengine.core.sched_output import SchedulerOutput
from inferengine.model.layers.pooler import pool_rows, postprocess
from inferengine.pooling_params import PoolingParams


class _State(Protocol):
    num_computed_tokens: int
    prompt_token_ids: list[int]


class _Step(Protocol):
    req_ids: list[str]  # in batch order
    num_scheduled: list[int]


class PoolingRunner:
    """The pooling requests the runner holds, and their partial pools across prefill chunks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model  # its LM head scores yes/no rerankers
        self.params: dict[str, PoolingParams] = {}
        self.partial: dict[str, torch.Tensor] = {}

    def update(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.params.pop(req_id, None)
            self.partial.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.pooling_params is not None:  # new, or back after a preemption: start over
                self.params[new.req_id] = new.pooling_params
                self.partial.pop(new.req_id, None)

    def pool(
        self,
        step: _Step,
        states: Mapping[str, _State],
        hidden: torch.Tensor,
    ) -> dict[str, bytes]:
        """req -> float32 bytes for the pooling requests whose prompt ends in this step."""
        if not self.params:
            return {}
        done: list[tuple[str, torch.Tensor, PoolingParams]] = []
        flat = 0
        for req_id, n in zip(step.req_ids, step.num_scheduled, strict=True):
            params = self.params.get(req_id)
            if params is not None:
                state = states[req_id]
                start, num_prompt = state.num_computed_tokens, len(state.prompt_token_ids)
                rows = hidden[flat : flat + min(n, num_prompt - start)]
                pooled = pool_rows(params.pooling_type, rows, start, self.partial.get(req_id))
                if start + n >= num_prompt and params.score_token_ids is not None:
                    pooled = self._yes_no(rows[-1:], params.score_token_ids)
                elif start + n >= num_prompt and params.score_head:
                    pooled = torch.sigmoid(
                        self.model.classify(pooled[None].to(rows.dtype))[0].float()
                    )
                if start + n >= num_prompt:
                    if params.pooling_type == "MEAN":
                        pooled = pooled / num_prompt
                    done.append((req_id, pooled, params))
                    self.partial.pop(req_id, None)
                else:
                    self.partial[req_id] = pooled
            flat += n
        return {  # one host copy per finished vector
            req_id: postprocess(vector, params).numpy().astype("<f4").tobytes()
            for req_id, vector, params in done
        }

    def _yes_no(self, last_row: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
        """[P(yes)]: the softmax over the (no, yes) logits of the last prompt token."""
        logits = self.model.compute_logits(last_row)[0, token_ids].float()
        return torch.softmax(logits, dim=-1)[1:]
