"""`POST /v1/completions`: prompts (text or token ids, one or a batch) to completions, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from inferengine.entrypoints.openai.errors import stream_error_event
from inferengine.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from inferengine.entrypoints.openai.serving_engine import (
    OpenAIServing,
    make_usage,
    random_id,
    sse,
)
from inferengine.entrypoints.openai.streaming import (
    SSE_DONE,
    EngineStream,
    SSEResponse,
    close_streams,
    merge_streams,
    unless_disconnected,
)
from inferengine.errors import InvalidRequestError
from inferengine.outputs import CompletionOutput, RequestOutput
from inferengine.retention import Retention
from inferengine.sampling_params import RequestOutputKind, SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for the legacy completions endpoint


class Prompt:
    """One prompt of a (possibly batched) completion request."""

    def __init__(self, text: str | None, token_ids: list[int]):
        self.text = text
        self.token_ids = token_ids

    def engine_input(self) -> dict[str, Any]:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


class ServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request) -> Response | CompletionResponse:
        prompts, params, retention = self.prepare(req)
        request_id = random_id("cmpl")
        inputs = [p.engine_input() for p in prompts]
        streams = await self.start(request_id, inputs, params, req, retention)
        if req.stream:
            return SSEResponse(self._stream(request_id, req, prompts, streams))
        return await unless_disconnected(raw, self._full(request_id, req, prompts, streams))

    def prepare(
        self, req: CompletionRequest
    ) -> tuple[list[Prompt], list[SamplingParams], Retention]:
        """Check the request; its prompts, one `SamplingParams` each and the `Retention` of all
        (also used by run-batch)."""
        self.check_model(req.model)
        self.check_fields(req)
        retention = self.retention(req)
        if req.suffix is not None:
            raise InvalidRequestError("suffix is not supported.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequestError("best_of is not supported; use n.", param="best_of")
        prompts = self._prompts(req)
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        params = [
            self.sampling_params(
                req,
                self.resolve_max_tokens(
                    req.max_tokens,
                    len(p.token_ids),
                    self.default_max_tokens or DEFAULT_MAX_TOKENS,
                    "prompt",
                ),
                kind,
                logprobs=req.logprobs,
                prompt_logprobs=prompt_logprobs,
            )
            for p in prompts
        ]
        return prompts, params, retention

    def _prompts(self, req: CompletionRequest) -> list[Prompt]:
        raw = req.prompt
        if isinstance(raw, str):
            items: list[Any] = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            items = [raw]
        else:
            items = list(raw)
        if not items:
            raise InvalidRequestError("prompt must not be empty.", param="prompt")
        limit = self.limits.max_request_seqs
        if len(items) * req.n > limit:
            raise InvalidRequestError(
                f"This request asks for {len(items) * req.n} sequences ({len(items)} prompt(s) x "
                f"n={req.n}); the server takes at most {limit} per request (--max-request-seqs). "
                "Split it into several requests.",
                param="prompt",
            )
        prompts = []
        for item in items:
            if isinstance(item, str):
                ids = self.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
                prompts.append(Prompt(item, ids))
            else:
                prompts.append(Prompt(None, list(item)))
        return prompts

    def _prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids)
        return prompt.text

    def _echo_logprobs(self, prompt: Prompt, output: RequestOutput) -> CompletionLogprobs:
        positions = output.prompt_logprobs or [None] * len(prompt.token_ids)
        return self.completion_logprobs(prompt.token_ids, positions, 0)

    # ---- non-streaming ---------------------------------------------------------------------

    async def _full(
        self,
        request_id: str,
        req: CompletionRequest,
        prompts: list[Prompt],
        streams: list[EngineStream],
    ) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, output in merge_streams(streams):
                finals[i] = output
        finally:
            await close_streams(streams)
        return self.response(request_id, req, prompts, [finals[i] for i in range(len(prompts))])

    def response(
        self,
        request_id: str,
        req: CompletionRequest,
        prompts: list[Prompt],
        finals: list[RequestOutput],
    ) -> CompletionResponse:
        """The non-streaming reply from each prompt's final output (also used by run-batch)."""
        choices: list[CompletionChoice] = []
        prompt_tokens = completion_tokens = cached = 0
        for i, (prompt, output) in enumerate(zip(prompts, finals, strict=True)):
            _raise_engine_error(output)
            prompt_tokens += len(prompt.token_ids)
            cached += output.num_cached_tokens
            for completion in sorted(output.outputs, key=lambda c: c.index):
                completion_tokens += len(completion.token_ids)
                choices.append(
                    self._choice(i * req.n + completion.index, req, prompt, output, completion)
                )
        return CompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=make_usage(prompt_tokens, completion_tokens, cached),
            kv_transfer_params=finals[0].kv_transfer_params if finals else None,
        )

    def _choice(
        self,
        index: int,
        req: CompletionRequest,
        prompt: Prompt,
        output: RequestOutput,
        completion: CompletionOutput,
    ) -> CompletionChoice:
        text = completion.text
        logprobs = None
        prefix = self._prompt_text(prompt) if req.echo else ""
        if req.logprobs is not None:
            logprobs = self.completion_logprobs(
                completion.token_ids, completion.logprobs or [], len(prefix)
            )
            if req.echo:
                logprobs = _join(self._echo_logprobs(prompt, output), logprobs)
        return CompletionChoice(
            index=index,
            text=prefix + text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    # ---- streaming -------------------------------------------------------------------------

    async def _stream(
        self,
        request_id: str,
        req: CompletionRequest,
        prompts: list[Prompt],
        streams: list[EngineStream],
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        n = req.n
        sent_chars: dict[int, int] = {}
        completion_tokens = cached = 0
        try:
            async for i, output in merge_streams(streams):
                _raise_engine_error(output)
                for completion in output.outputs:
                    index = i * n + completion.index
                    text, logprobs = completion.text, None
                    offset = sent_chars.get(index, 0)
                    if index not in sent_chars and req.echo:
                        prefix = self._prompt_text(prompts[i])
                        if req.logprobs is not None:
                            logprobs = self._echo_logprobs(prompts[i], output)
                        text, offset = prefix + text, len(prefix)
                    if req.logprobs is not None:
                        new = self.completion_logprobs(
                            completion.token_ids, completion.logprobs or [], offset
                        )
                        logprobs = new if logprobs is None else _join(logprobs, new)
                    sent_chars[index] = offset + len(completion.text)
                    completion_tokens += len(completion.token_ids)
                    # A chunk for every new token, even one with no text yet (as vLLM sends).
                    if not text and not completion.token_ids and completion.finish_reason is None:
                        continue
                    choice = CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                    yield sse(self._chunk(request_id, created, [choice]))
                if output.finished:
                    cached += output.num_cached_tokens
            if req.stream_options is not None and req.stream_options.include_usage:
                prompt_tokens = sum(len(p.token_ids) for p in prompts)
                chunk = self._chunk(request_id, created, [])
                chunk.usage = make_usage(prompt_tokens, completion_tokens, cached)
                yield sse(chunk)
        except Exception as e:
            yield stream_error_event(e)
        finally:
            await close_streams(streams)
        yield SSE_DONE

    def _chunk(self, request_id: str, created: int, choices: list[CompletionChoice]):
        return CompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices
        )


def _join(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=a.text_offset + b.text_offset,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        tokens=a.tokens + b.tokens,
        top_logprobs=a.top_logprobs + b.top_logprobs,
    )


def _raise_engine_error(output: RequestOutput) -> None:
    if output.error:
        raise InvalidRequestError(output.error)
