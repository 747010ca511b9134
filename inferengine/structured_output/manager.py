"""`StructuredOutputManager`: the engine core's side of structured output.

A request with `structured_outputs` gets a matcher built on a worker thread (the step loop never
waits for a grammar); it joins the scheduler once the matcher is ready, or fails with the
grammar's error. A grammar compiled once is kept (by grammar text and end tokens) and copied for
later requests with the same schema. Each step, the rows that sample get their allowed tokens as
a packed bitmask (bit `t % 32` of word `t // 32`; numpy, no torch), filled on llguidance's
threads, that travels in the `SchedulerOutput`; the worker masks the logits with it before
sampling. Sampled tokens advance the matchers. A reasoning model's grammar waits for the token
that ends its reasoning (`reasoning_end_token_id`): until then its rows are not masked.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from inferengine.core.request import Request, RequestStatus
from inferengine.logger import init_logger
from inferengine.structured_output.grammar import grammar_text, make_tokenizer, mask_width
from inferengine.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from inferengine.core.engine_io import EngineCoreOutputs
    from inferengine.core.scheduler import Scheduler

logger = init_logger(__name__)

COMPILED_CACHE_SIZE = 128  # grammars kept compiled, by grammar text and end tokens


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
        self.reasoning: dict[str, int] = {}  # request -> the token its grammar starts after
        self._compiled: OrderedDict[tuple[str, tuple[int, ...]], Any] = OrderedDict()
        self._executor: Any = None

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
                self._hf_tokenizer = load_tokenizer(self.tokenizer_path)
                # set before any matcher is handed out, so every mask has this width
                self.words = (mask_width(self._hf_tokenizer, self.vocab_size) + 31) // 32
            tokenizer = make_tokenizer(self._hf_tokenizer, self.vocab_size, list(eos))
            self._ll_tokenizers[eos] = tokenizer
        assert params.structured_outputs is not None
        key = (grammar_text(params.structured_outputs), eos)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = llguidance.LLMatcher(tokenizer, key[0])
            if compiled.is_error():
                raise ValueError(compiled.get_error())
            self._compiled[key] = compiled
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return compiled.deep_copy()  # the compiled one never advances

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
                structured = request.sampling_params.structured_outputs
                assert structured is not None
                if not structured.reasoning_ended_in(request.prompt_token_ids):
                    assert structured.reasoning_end_token_id is not None
                    self.reasoning[req_id] = structured.reasoning_end_token_id
            except Exception as e:  # the grammar's own words, to the client
                failed[req_id] = f"the structured output grammar failed to build: {e}"
        return ready, failed

    def bitmask(
        self, req_ids: list[str], requests: dict[str, Request], drafts: dict[str, list[int]]
    ) -> tuple[list[str], bytes]:
        """The requests of `req_ids` (scheduled this step) that sample under a grammar, and
        their packed allowed tokens: one row per sampled position, the current one and then
        one after each of the request's `drafts` (the matcher walks the drafts and comes back).
        After a draft the grammar refuses, rows allow everything: the verifier rejects there.
        A request still reasoning gets rows only if a draft ends its reasoning: all tokens up
        to that draft, the grammar's after it."""
        import llguidance.numpy

        rows = []
        for r in req_ids:
            if r not in self.matchers:
                continue
            q = requests.get(r)
            if q is None or q.num_computed_tokens < q.num_tokens:
                continue  # a prefill chunk that does not sample
            if r in self.reasoning and self.reasoning[r] not in drafts.get(r, ()):
                continue
            rows.append(r)
        if not rows:
            return [], b""
        mask = np.zeros((sum(1 + len(drafts.get(r, ())) for r in rows), self.words), np.int32)
        plain: list[tuple[Any, int]] = []  # (matcher, row) of rows without drafts
        i = 0
        for req_id in rows:
            matcher, own = self.matchers[req_id], drafts.get(req_id, ())
            if not own and req_id not in self.reasoning:
                plain.append((matcher, i))
            else:
                self._fill_with_drafts(matcher, own, self.reasoning.get(req_id), mask, i)
            i += 1 + len(own)
        if len(plain) > 1:
            llguidance.numpy.fill_next_token_bitmask_par(self._parallel(), plain, mask)
        elif plain:
            llguidance.numpy.fill_next_token_bitmask(plain[0][0], mask, plain[0][1])
        return rows, mask.tobytes()

    @staticmethod
    def _fill_with_drafts(
        matcher: Any, drafts: list[int], reasoning_end: int | None, mask: np.ndarray, row: int
    ) -> None:
        import llguidance.numpy

        active, valid, walked = reasoning_end is None, True, 0
        for k in range(len(drafts) + 1):
            if not active:
                mask[row + k] = -1
                active = k < len(drafts) and drafts[k] == reasoning_end
                continue
            if valid:
                llguidance.numpy.fill_next_token_bitmask(matcher, mask, row + k)
            else:
                mask[row + k] = -1
            if k < len(drafts):
                valid = (
                    valid
                    and not matcher.is_stopped()
                    and matcher.try_consume_tokens([drafts[k]]) == 1  # no error state if not
                )
                walked += valid
        if walked:
            matcher.rollback(walked)

    def _parallel(self) -> Any:
        if self._executor is None:
            import llguidance

            # Masks are filled while the GPU runs the step before; a few threads suffice and
            # leave cores to the workers.
            self._executor = llguidance.LLExecutor(max(1, min(8, (os.cpu_count() or 2) // 2)))
        return self._executor

    def accept(self, req_id: str, token_ids: list[int]) -> tuple[bool, bool]:
        """Advance the request's matcher: (whether the grammar took the tokens, whether it is
        complete and wants nothing more). Tokens up to the end of reasoning pass it by."""
        matcher = self.matchers.get(req_id)
        if matcher is None:
            return True, False
        end = self.reasoning.get(req_id)
        if end is not None:
            if end not in token_ids:
                return True, False
            del self.reasoning[req_id]
            token_ids = token_ids[token_ids.index(end) + 1 :]
        for token_id in token_ids:
            if matcher.is_stopped():
                break
            if not matcher.consume_token(token_id):
                logger.warning("request %s: the grammar refused token %d", req_id, token_id)
                return False, True
        return True, matcher.is_stopped()

    def advance(self, outputs: EngineCoreOutputs, scheduler: Scheduler) -> None:
        """Feed a step's sampled tokens to the matchers. A complete grammar allows only the end
        of text, so its request stops there like any other (the same tokens with and without
        speculation); one that cannot stop on EOS (`ignore_eos`) is ended by the grammar. A
        grammar that refused a token (only if masks and tokens went apart) ends its request
        with an error."""
        for out in outputs.outputs:
            took, complete = self.accept(out.request_id, out.new_token_ids)
            request = scheduler.requests.get(out.request_id)
            stops_itself = (
                request is not None
                and request.eos_token_id is not None
                and not request.sampling_params.ignore_eos
            )
            if out.finish_reason is None and complete and not (took and stops_itself):
                status = RequestStatus.FINISHED_STOPPED if took else RequestStatus.FINISHED_ABORTED
                (request,) = scheduler.finish_requests([out.request_id], status) or [None]
                if request is not None:
                    out.finish_reason = request.finish_reason
                if not took:
                    outputs.errors = {
                        **outputs.errors,
                        out.request_id: "the grammar refused a token",
                    }
            if out.finish_reason is not None:
                self.finish(out.request_id)

    def finish(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.reasoning.pop(req_id, None)
        entry = self.waiting.pop(req_id, None)
        if entry is not None:
            entry[1].cancel()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
