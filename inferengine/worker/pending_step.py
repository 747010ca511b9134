"""`PendingStep`: a launched step whose sampled tokens are still on their way to the host.

The sampled ids (and logprobs) are copied into pinned memory without waiting; `resolve()`
waits for that copy only and returns the `ModelRunnerOutput`: data, nothing else changes (the
runner adds the tokens to its request state from it). With async scheduling the next step is
launched before this one resolves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from inferengine.core.sched_output import ModelRunnerOutput

if TYPE_CHECKING:
    from inferengine.sample.sampler import SamplerOutput


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class SpecResult:
    """A step that verified drafts: each sampling row emits `num_emitted[i]` of `tokens[i]`.

    All-greedy steps verify on the host instead: `tokens` is then the target's argmax at every
    logits row ([sum(1 + k_i)]), `greedy_drafts` each row's drafts, and a row emits its drafts
    while they equal the argmax, then the argmax where they stop (greedy rejection sampling).
    """

    tokens: torch.Tensor  # int64 [S, K + 1], or [sum(1 + k_i)] with greedy_drafts
    num_emitted: torch.Tensor | None  # int64 [S]; None with greedy_drafts
    plain_rows: list[int]  # sampling rows without drafts, in the order of the sampler's result
    greedy_drafts: list[list[int]] | None = None


def accept_greedy(argmax: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Each row's emitted tokens: its drafts while they match the argmax, then the argmax."""
    emitted, start = [], 0
    for row in drafts:
        targets = argmax[start : start + len(row) + 1]
        n = 0
        while n < len(row) and row[n] == targets[n]:
            n += 1
        emitted.append(targets[: n + 1])
        start += len(row) + 1
    return emitted


class PendingStep:
    """`sample_rows`: the batch rows that sample (`output.req_ids[row]`), with the logprobs
    each asks for (`num_logprobs`, None: none)."""

    def __init__(
        self,
        output: ModelRunnerOutput,
        sample_rows: list[int],
        num_logprobs: list[int | None],
        result: SamplerOutput | None,
        spec: SpecResult | None = None,
    ):
        self.output = output
        self.sample_rows = sample_rows
        self.num_logprobs = num_logprobs
        self.graph_size: int | None = None  # the CUDA graph this step replayed, if any
        self._resolved = False
        self.sampled_device = result.sampled if result is not None else None
        self._host: list[torch.Tensor] = []
        self._event: torch.cuda.Event | None = None
        # With drafts, only rows without them are in the sampler's result (logprobs).
        self._result_row: dict[int, int] | None = None
        if spec is not None:
            self.sampled_device = None  # several tokens per row: no device hand-off
            self._result_row = {row: j for j, row in enumerate(spec.plain_rows)}
            tensors = [spec.tokens]
            if spec.num_emitted is not None:
                tensors.append(spec.num_emitted)
        elif result is not None:
            tensors = [result.sampled]
        if result is not None and result.logprobs is not None:
            assert result.logprob_token_ids is not None and result.sampled_ranks is not None
            tensors += [result.logprob_token_ids, result.logprobs, result.sampled_ranks]
        self._spec = spec is not None
        self._greedy_drafts = spec.greedy_drafts if spec is not None else None
        if spec is not None or result is not None:
            self._host = [_to_host(t) for t in tensors]
            if tensors[0].is_cuda:
                self._event = torch.cuda.Event()
                self._event.record()

    def provide_grammar(self, req_ids: list[str], bitmask: bytes) -> None:
        """Nothing to mask: a step with grammar masks deferred returns a `DeferredSampling`
        unless it samples nothing here."""
        assert not req_ids, "grammar masks for a step that samples nothing here"

    @property
    def resolved(self) -> bool:
        return self._resolved

    def resolve(self) -> ModelRunnerOutput:
        """Wait for the sampled ids and return the step's output (filled once)."""
        if self._resolved:
            return self.output
        self._resolved = True
        if not self._host:
            return self.output
        if self._event is not None:
            self._event.synchronize()
        if self._greedy_drafts is not None:
            emitted = accept_greedy(self._host[0].tolist(), self._greedy_drafts)
            extra = []
        elif self._spec:
            rows, counts = self._host[0].tolist(), self._host[1].tolist()
            emitted = [r[:c] for r, c in zip(rows, counts, strict=True)]
            extra = self._host[2:]
        else:
            emitted = [[t] for t in self._host[0].tolist()]
            extra = self._host[1:]
        logprobs = [t.tolist() for t in extra] if extra else None
        return self._fold(emitted, logprobs)

    def _fold(self, emitted: list[list[int]], logprobs: list | None) -> ModelRunnerOutput:
        out = self.output
        for i, (row, num_top) in enumerate(zip(self.sample_rows, self.num_logprobs, strict=True)):
            out.sampled_token_ids[row] = emitted[i]
            j = i if self._result_row is None else self._result_row.get(i)
            if num_top is not None and logprobs is not None and j is not None:
                ids, values, ranks = logprobs
                out.logprobs[out.req_ids[row]] = (
                    [ids[j][: 1 + num_top]],
                    [values[j][: 1 + num_top]],
                    [ranks[j]],
                )
        return out


class DeferredSampling:
    """A step whose forward is launched and whose sampling waits for the grammar masks: the
    engine core computes them from the previous step's tokens while this forward runs."""

    def __init__(self, sample, graph_size: int | None):
        self._sample = sample  # (grammar request ids, packed bitmask) -> PendingStep
        self.graph_size = graph_size
        self._pending: PendingStep | None = None

    def provide_grammar(self, req_ids: list[str], bitmask: bytes) -> None:
        self._pending = self._sample(req_ids, bitmask)

    def resolve(self) -> ModelRunnerOutput:
        assert self._pending is not None, "the step's grammar masks were never provided"
        return self._pending.resolve()
