"""Turns engine-core token ids into `RequestOutput`s: detokenize, stop strings, logprobs, `n`.

Runs beside the user (the API process or the `LLM` caller), never in the engine core. A stop
string found here ends the request, and the caller aborts it in the core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from inferengine.core.engine_io import EngineCoreOutput, LogprobsLists
from inferengine.core.request import FinishReason
from inferengine.engine.detokenizer import IncrementalDetokenizer
from inferengine.metrics.stats import FinishedRequestStats, IterationStats
from inferengine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from inferengine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ParentRequest:
    """Fans `n` samples out as child requests and gathers their completions."""

    request_id: str
    n: int
    kind: RequestOutputKind
    children: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        arrival_time: float,
        parent: ParentRequest | None = None,
        index: int = 0,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.parent = parent
        self.index = index
        self.tokenizer = tokenizer
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
            if params.detokenize and tokenizer is not None
            else None
        )
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None
        )
        self.text = ""
        self.sent_text_len = 0
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict | None = None
        self.pooled: bytes | None = None  # a pooling request's vector (float32 bytes)
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.max_stop_len = max((len(s) for s in params.stop), default=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # ---- applying one core output ----------------------------------------------------------

    def apply(self, out: EngineCoreOutput, now: float, stats: IterationStats | None) -> bool:
        """Fold in new tokens; True when a stop string ended the request here."""
        m = self.metrics
        if out.scheduled_time:
            m.queued_time, m.first_scheduled_time = out.queued_time, out.scheduled_time
        if out.new_token_ids:
            if stats is not None:
                stats.num_generation_tokens += len(out.new_token_ids)
                if m.first_token_time is None:
                    stats.num_prompt_tokens += len(self.prompt_token_ids)
                    stats.time_to_first_tokens.append(now - m.arrival_time)
                elif m.last_token_time is not None:
                    stats.inter_token_latencies.append(now - m.last_token_time)
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
        self.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.pooled is not None:
            self.pooled = out.pooled
        if out.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self._add_prompt_logprobs(out.new_prompt_logprobs)
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and self.logprobs is not None:
            self._add_logprobs(out.new_logprobs)
        stopped_here = False
        if self.detokenizer is not None and out.new_token_ids:
            text_before = len(self.text)
            final = out.finish_reason is not None
            self.text += self.detokenizer.update(out.new_token_ids, final)
            if self.params.stop:
                stopped_here = self._check_stop_strings(text_before)
        if not stopped_here and out.finish_reason is not None:
            self.finish_reason = str(FinishReason(out.finish_reason))
            self.stop_reason = out.stop_reason
        if self.finished:
            m.finished_time = now
            if stats is not None:
                stats.finished.append(self._finished_stats(now))
        return stopped_here

    def _finished_stats(self, now: float) -> FinishedRequestStats:
        m = self.metrics
        scheduled = m.first_scheduled_time or m.arrival_time
        first_token = m.first_token_time or now
        return FinishedRequestStats(
            finish_reason=self.finish_reason or "abort",
            e2e_latency=now - m.arrival_time,
            queue_time=max(0.0, scheduled - (m.queued_time or m.arrival_time)),
            prefill_time=max(0.0, first_token - scheduled),
            decode_time=max(0.0, (m.last_token_time or first_token) - first_token),
            num_prompt_tokens=len(self.prompt_token_ids),
            num_generation_tokens=len(self.token_ids),
        )

    def _check_stop_strings(self, text_before: int) -> bool:
        # A stop string completed by the new text starts at most max_stop_len - 1 before it.
        # Several new tokens may complete several stop strings: the earliest ends the text.
        window_start = max(0, text_before - self.max_stop_len + 1)
        found = [(self.text.find(stop, window_start), i) for i, stop in enumerate(self.params.stop)]
        found = [(at, i) for at, i in found if at != -1]
        if not found:
            return False
        at, first = min(found)  # a tie: the one listed first
        stop = self.params.stop[first]
        end = at + len(stop) if self.params.include_stop_str_in_output else at
        self.text = self.text[:end]
        self.finish_reason = "stop"
        self.stop_reason = stop
        return True

    def _decoded(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def _position(self, ids: list[int], values: list[float], rank: int) -> PositionLogprobs:
        entry: PositionLogprobs = {}
        for i, (token_id, value) in enumerate(zip(ids[1:], values[1:], strict=True)):
            entry[token_id] = Logprob(value, i + 1, self._decoded(token_id))
        if ids[0] not in entry:
            entry[ids[0]] = Logprob(values[0], rank, self._decoded(ids[0]))
        return entry

    def _add_logprobs(self, lp: LogprobsLists) -> None:
        assert self.logprobs is not None and self.cumulative_logprob is not None
        for ids, values, rank in zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True):
            self.logprobs.append(self._position(ids, values, rank))
            self.cumulative_logprob += values[0]

    def _add_prompt_logprobs(self, lp: LogprobsLists) -> None:
        assert self.prompt_logprobs is not None
        for row, (ids, values, rank) in enumerate(
            zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True)
        ):
            self.prompt_logprobs[lp.start + row + 1] = self._position(ids, values, rank)

    # ---- building outputs ----------------------------------------------------------------

    def completion(self, delta: bool) -> CompletionOutput:
        """The completion so far; with `delta`, only what was not sent yet."""
        visible = len(self.text)
        if not self.finished and self.max_stop_len and not self.params.include_stop_str_in_output:
            visible = max(self.sent_text_len, visible - self.max_stop_len + 1)  # may start a stop
        text_from = self.sent_text_len if delta else 0
        tokens_from = self.sent_tokens if delta else 0
        logprobs_from = self.sent_logprobs if delta else 0
        out = CompletionOutput(
            index=self.index,
            text=self.text[text_from:visible],
            token_ids=self.token_ids[tokens_from:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs[logprobs_from:] if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.sent_text_len = visible
        self.sent_tokens = len(self.token_ids)
        self.sent_logprobs = len(self.logprobs or [])
        return out


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        self.requests[request_id] = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            self.tokenizer,
            arrival_time or time.time(),
            parent,
            index,
        )
        if parent is not None:
            self.parents[parent.request_id] = parent

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort(self, request_ids: list[str], stats: IterationStats | None = None) -> None:
        """Forget these requests; each one not finished yet counts in `stats` as finished with
        reason "abort" (as vLLM counts a request its client left)."""
        now = time.time()
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None and not state.finished and stats is not None:
                stats.finished.append(state._finished_stats(now))

    def process_outputs(
        self,
        outputs: list[EngineCoreOutput],
        errors: dict[str, str] | None = None,
        stats: IterationStats | None = None,
    ) -> tuple[list[RequestOutput], list[str]]:
        """(outputs ready for their callers, request ids to abort in the core)."""
        now = time.time()
        ready: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            if state.apply(out, now, stats):
                to_abort.append(out.request_id)
            error = (errors or {}).get(out.request_id)
            request_output = self._make_output(state, error)
            if state.finished:
                del self.requests[out.request_id]
            if request_output is not None:
                ready.append(request_output)
        return ready, to_abort

    def _make_output(self, state: RequestState, error: str | None) -> RequestOutput | None:
        kind = state.params.output_kind
        parent = state.parent
        if parent is None:
            if kind == RequestOutputKind.FINAL_ONLY and not state.finished:
                return None
            completion = state.completion(delta=kind == RequestOutputKind.DELTA)
            return self._request_output(
                state, state.request_id, [completion], state.finished, error
            )
        parent.children[state.index] = state.completion(delta=kind == RequestOutputKind.DELTA)
        if state.finished:
            parent.num_finished += 1
        all_done = parent.num_finished == parent.n
        if all_done:
            self.parents.pop(parent.request_id, None)
        if kind == RequestOutputKind.FINAL_ONLY:
            if not all_done:
                return None
            completions = [parent.children[i] for i in sorted(parent.children)]
        elif kind == RequestOutputKind.DELTA:
            completions = [parent.children[state.index]]
        else:
            completions = [parent.children[i] for i in sorted(parent.children)]
        return self._request_output(state, parent.request_id, completions, all_done, error)

    @staticmethod
    def _request_output(
        state: RequestState,
        request_id: str,
        completions: list[CompletionOutput],
        finished: bool,
        error: str | None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
            error=error,
            kv_transfer_params=state.kv_transfer_params,
            pooled=state.pooled,
        )
