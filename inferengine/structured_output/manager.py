"""`StructuredOutputManager`: the engine core's side of structured output.

A request with `structured_outputs` gets a matcher built on a worker thread (the step loop never
waits for a grammar); it joins the scheduler once the matcher is ready, or fails with the
grammar's error. Each step, the rows that sample get their allowed tokens as a packed bitmask
(bit `t % 32` of word `t // 32`; numpy, no torch) that travels in the `SchedulerOutput`; the
worker masks the logits with it before sampling. Sampled tokens advance the matchers.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from inferengine.core.request import Request
from inferengine.logger import init_logger
from inferengine.structured_output.grammar import grammar_text, make_tokenizer

logger = init_logger(__name__)


class StructuredOutputManager:
    def __init__(self, tokenizer_path: str, vocab_size: int):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._hf_tokenizer: Any = None
        self._ll_tokenizers: dict[tuple[int, ...], Any] = {}
        self.waiting: dict[str, tuple[Request, Future]] = {}  # matcher being built
        self.matchers: dict[str, Any] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.waiting or req_id in self.matchers

    def submit(self, request: Request) -> None:
        self.waiting[request.request_id] = (request, self._pool.submit(self._build, request))

    def _build(self, request: Request):
        import llguidance

        params = request.sampling_params
        eos = tuple(
            t for t in (request.eos_token_id, *params.extra_stop_token_ids) if t is not None
        )
        tokenizer = self._ll_tokenizers.get(eos)
        if tokenizer is None:
            if self._hf_tokenizer is None:
                from inferengine.engine.input_processor import load_tokenizer

                self._hf_tokenizer = load_tokenizer(self.tokenizer_path)
            tokenizer = make_tokenizer(self._hf_tokenizer, self.vocab_size, list(eos))
            self._ll_tokenizers[eos] = tokenizer
        assert params.structured_outputs is not None
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(params.structured_outputs))
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def wait(self, timeout_s: float) -> None:
        """Block until a matcher is built or `timeout_s` passes (an engine with nothing else
        to do must not spin: the builder thread needs the interpreter)."""
        futures = [future for _, future in self.waiting.values()]
        if futures:
            concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def take_ready(self) -> tuple[list[Request], dict[str, str]]:
        """Requests whose matcher is built, and errors of those whose grammar failed."""
        ready, failed = [], {}
        for req_id, (request, future) in list(self.waiting.items()):
            if not future.done():
                continue
            del self.waiting[req_id]
            try:
                self.matchers[req_id] = future.result()
                ready.append(request)
            except Exception as e:  # the grammar's own words, to the client
                failed[req_id] = f"the structured output grammar failed to build: {e}"
        return ready, failed

    def bitmask(
        self, req_ids: list[str], requests: dict[str, Request], drafts: dict[str, list[int]]
    ) -> tuple[list[str], bytes]:
        """The requests of `req_ids` (scheduled this step) that sample under a grammar, and
        their packed allowed tokens: one row per sampled position, the current one and then
        one after each of the request's `drafts` (the matcher walks the drafts and comes back).
        After a draft the grammar refuses, rows allow everything: the verifier rejects there."""
        import llguidance.numpy

        rows = [
            r
            for r in req_ids
            if r in self.matchers
            and (q := requests.get(r)) is not None
            and q.num_computed_tokens >= q.num_tokens
        ]
        if not rows:
            return [], b""
        mask = np.zeros((sum(1 + len(drafts.get(r, ())) for r in rows), self.words), np.int32)
        i = 0
        for req_id in rows:
            matcher, walked, valid = self.matchers[req_id], 0, True
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, i)
            for token_id in drafts.get(req_id, ()):
                i += 1
                valid = (
                    valid
                    and not matcher.is_stopped()
                    and matcher.try_consume_tokens([token_id]) == 1  # no error state if not
                )
                if valid:
                    walked += 1
                    llguidance.numpy.fill_next_token_bitmask(matcher, mask, i)
                else:
                    mask[i] = -1
            if walked:
                matcher.rollback(walked)
            i += 1
        return rows, mask.tobytes()

    def accept(self, req_id: str, token_ids: list[int]) -> tuple[bool, bool]:
        """Advance the request's matcher: (whether the grammar took the tokens, whether it is
        complete and wants nothing more)."""
        matcher = self.matchers.get(req_id)
        if matcher is None:
            return True, False
        for token_id in token_ids:
            if matcher.is_stopped():
                break
            if not matcher.consume_token(token_id):
                logger.warning("request %s: the grammar refused token %d", req_id, token_id)
                return False, True
        return True, matcher.is_stopped()

    def finish(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        entry = self.waiting.pop(req_id, None)
        if entry is not None:
            entry[1].cancel()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
