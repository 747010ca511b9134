"""`POST /v1/chat/completions`: messages through the chat template to replies, streamed or not."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from inferengine.entrypoints.cache_breakpoints import cache_breakpoints, take_cache_control
from inferengine.entrypoints.openai.errors import stream_error_event
from inferengine.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
)
from inferengine.entrypoints.openai.serving_engine import (
    OpenAIServing,
    make_usage,
    random_id,
    refuse_unsupported,
    sse,
)
from inferengine.entrypoints.openai.streaming import (
    SSE_DONE,
    EngineStream,
    SSEResponse,
    close_streams,
    unless_disconnected,
)
from inferengine.errors import InvalidRequestError
from inferengine.outputs import CompletionOutput, RequestOutput
from inferengine.retention import Retention
from inferengine.sampling_params import RequestOutputKind, SamplingParams


def message_dicts(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], dict[int, float]]:
    """Messages as the chat template wants them (content parts other than text refused, text
    parts joined), and the lease in seconds of each message marked with `cache_control`."""
    dicts, leases = take_cache_control([m.model_dump(exclude_none=True) for m in messages])
    out = []
    for item in dicts:
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        f"message content parts of type {part.get('type')!r} are not supported; "
                        "send text.",
                        param="messages",
                    )
                texts.append(part["text"])
            item["content"] = "\n".join(texts)
        out.append(item)
    return out, leases


def chat_template_kwargs(req: Any) -> dict[str, Any]:
    if req.add_generation_prompt and req.continue_final_message:
        raise InvalidRequestError(
            "add_generation_prompt and continue_final_message cannot both be true.",
            param="continue_final_message",
        )
    kwargs = dict(req.chat_template_kwargs or {})
    kwargs["add_generation_prompt"] = req.add_generation_prompt
    kwargs["chat_template"] = req.chat_template
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    return kwargs


class ServingChat(OpenAIServing):
    async def create(
        self, req: ChatCompletionRequest, raw: Request
    ) -> Response | ChatCompletionResponse:
        prompt, params, num_top, retention = self.prepare(req)
        num_prompt = len(prompt["prompt_token_ids"])
        request_id = random_id("chatcmpl")
        streams = await self.start(request_id, [prompt], [params], req, retention)
        if req.stream:
            return SSEResponse(self._stream(request_id, req, num_prompt, num_top, streams[0]))
        return await unless_disconnected(
            raw, self._full(request_id, num_prompt, num_top, streams[0])
        )

    def prepare(
        self, req: ChatCompletionRequest
    ) -> tuple[dict[str, Any], SamplingParams, int | None, Retention]:
        """Check the request; its templated prompt, `SamplingParams`, number of top logprobs
        (None: no logprobs) and `Retention` (with the breakpoints of its `cache_control` marks).
        Also used by run-batch."""
        self.check_model(req.model)
        self.check_fields(req)
        self._check_unsupported(req)
        retention = self.retention(req)
        messages, leases = message_dicts(req.messages)
        template_kwargs = chat_template_kwargs(req)
        processor = self.engine.input_processor
        prompt = processor.chat_prompt(messages, **template_kwargs)
        if leases:
            breakpoints = cache_breakpoints(
                processor, messages, leases, prompt["prompt_token_ids"], template_kwargs
            )
            retention = dataclasses.replace(retention, breakpoints=tuple(breakpoints))
        num_prompt = len(prompt["prompt_token_ids"])
        requested = req.max_completion_tokens or req.max_tokens
        max_tokens = self.resolve_max_tokens(requested, num_prompt, None, "messages")
        num_top = None
        if req.logprobs:
            num_top = req.top_logprobs or 0
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = self.sampling_params(req, max_tokens, kind, logprobs=num_top)
        return prompt, params, num_top, retention

    @staticmethod
    def _check_unsupported(req: ChatCompletionRequest) -> None:
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError(
                "top_logprobs needs logprobs to be true.", param="top_logprobs"
            )
        # Tools with tool_choice "none" are accepted and left out of the prompt.
        if req.tool_choice != "none":
            refuse_unsupported("tools", req.tools)
        refuse_unsupported("tool_choice", req.tool_choice)

    def _logprobs(self, completion: CompletionOutput, num_top: int | None) -> ChatLogprobs | None:
        if num_top is None:
            return None
        return self.chat_logprobs(completion.token_ids, completion.logprobs or [], num_top)

    # ---- non-streaming ---------------------------------------------------------------------

    async def _full(
        self, request_id: str, num_prompt: int, num_top: int | None, stream: EngineStream
    ) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        try:
            async for output in stream:
                final = output
        finally:
            await stream.aclose()
        assert final is not None
        return self.response(request_id, num_prompt, num_top, final)

    def response(
        self, request_id: str, num_prompt: int, num_top: int | None, final: RequestOutput
    ) -> ChatCompletionResponse:
        """The non-streaming reply from the final output (also used by run-batch)."""
        if final.error:
            raise InvalidRequestError(final.error)
        choices = [
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=c.text),
                logprobs=self._logprobs(c, num_top),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in sorted(final.outputs, key=lambda c: c.index)
        ]
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=make_usage(num_prompt, completion_tokens, final.num_cached_tokens),
        )

    # ---- streaming -------------------------------------------------------------------------

    async def _stream(
        self,
        request_id: str,
        req: ChatCompletionRequest,
        num_prompt: int,
        num_top: int | None,
        stream: EngineStream,
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, choices=choices
            )

        completion_tokens = cached = 0
        try:
            role_sent = False
            async for output in stream:
                if output.error:
                    raise InvalidRequestError(output.error)
                if not role_sent:  # with the first output, as vLLM does
                    role_sent = True
                    for i in range(req.n):
                        role = ChatDelta(role="assistant", content="")
                        yield sse(chunk([ChatStreamChoice(index=i, delta=role)]))
                for c in output.outputs:
                    completion_tokens += len(c.token_ids)
                    logprobs = self._logprobs(c, num_top) if c.token_ids else None
                    # A chunk for every new token, even one with no text yet (as vLLM sends).
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    choice = ChatStreamChoice(
                        index=c.index,
                        delta=ChatDelta(content=c.text) if c.text else ChatDelta(),
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                    yield sse(chunk([choice]))
                if output.finished:
                    cached = output.num_cached_tokens
            if req.stream_options is not None and req.stream_options.include_usage:
                last = chunk([])
                last.usage = make_usage(num_prompt, completion_tokens, cached)
                yield sse(last)
        except Exception as e:
            yield stream_error_event(e)
        finally:
            await close_streams([stream])
        yield SSE_DONE
