"""`PendingStep`: a launched step whose sampled tokens are still on their way to the host.

The sampled ids (and logprobs) are copied into pinned memory without waiting; `resolve()`
waits for that copy only, appends the tokens to the runner's request state and returns the
`ModelRunnerOutput`. With async scheduling the next step is launched before this one resolves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from inferengine.core.sched_output import ModelRunnerOutput

if TYPE_CHECKING:
    from inferengine.sample.sampler import SamplerOutput
    from inferengine.worker.model_runner import RequestState


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class PendingStep:
    def __init__(
        self,
        output: ModelRunnerOutput,
        sample_rows: list[int],
        states: list[RequestState],
        result: SamplerOutput | None,
        token_buffer,
    ):
        self.output = output
        self.sample_rows = sample_rows
        self.states = states
        self.token_buffer = token_buffer
        self.graph_size: int | None = None  # the CUDA graph this step replayed, if any
        self._resolved = False
        self.sampled_device = result.sampled if result is not None else None
        self._host: list[torch.Tensor] = []
        self._event: torch.cuda.Event | None = None
        if result is not None:
            tensors = [result.sampled]
            if result.logprobs is not None:
                assert result.logprob_token_ids is not None and result.sampled_ranks is not None
                tensors += [result.logprob_token_ids, result.logprobs, result.sampled_ranks]
            self._host = [_to_host(t) for t in tensors]
            if result.sampled.is_cuda:
                self._event = torch.cuda.Event()
                self._event.record()

    def resolve(self) -> ModelRunnerOutput:
        """Wait for the sampled ids, fold them into the request state (once), return them."""
        if self._resolved:
            return self.output
        self._resolved = True
        if not self._host:
            return self.output
        if self._event is not None:
            self._event.synchronize()
        sampled = self._host[0].tolist()
        logprobs = [t.tolist() for t in self._host[1:]] if len(self._host) > 1 else None
        out = self.output
        for i, (row, state) in enumerate(zip(self.sample_rows, self.states, strict=True)):
            token = sampled[i]
            out.sampled_token_ids[row] = [token]
            if state.row >= 0:  # a request that finished meanwhile keeps no state
                state.output_token_ids.append(token)
                if state.num_tokens < self.token_buffer.shape[1]:
                    self.token_buffer[state.row, state.num_tokens] = token
                state.num_tokens += 1
            num_top = state.sampling_params.logprobs
            if num_top is not None and logprobs is not None:
                ids, values, ranks = logprobs
                out.logprobs[state.req_id] = (
                    [ids[i][: 1 + num_top]],
                    [values[i][: 1 + num_top]],
                    [ranks[i]],
                )
        return out
