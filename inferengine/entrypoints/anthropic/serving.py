"""`POST /v1/messages` and `/v1/messages/count_tokens`: a Messages request served by chat's path.

The request becomes a `ChatCompletionRequest` (`translate.py`); `ServingChat.prepare` renders it
through the chat template (tools, cache_control leases, tool grammars, reasoning) exactly as chat
does, and its `ReplyReader` reads the reply, which `reply.py` writes as Anthropic blocks. A stream
sends Anthropic's events: `message_start` (with the first output, so that its usage can say how
much of the prompt the cache held), `ping`, the blocks' events, `message_delta` (stop_reason and
the final usage) and `message_stop`; an error after the start is an `error` event.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from inferengine.entrypoints.anthropic.errors import stream_error_event
from inferengine.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from inferengine.entrypoints.anthropic.reply import (
    BlockStream,
    message,
    message_id,
    sse_event,
    stop_reason,
    usage,
)
from inferengine.entrypoints.anthropic.translate import translate
from inferengine.entrypoints.chat_messages import templated_prompt
from inferengine.entrypoints.openai.chat_reply import ReplyReader
from inferengine.entrypoints.openai.serving_chat import (
    ServingChat,
    chat_template_kwargs,
    message_dicts,
)
from inferengine.entrypoints.openai.streaming import (
    EngineStream,
    SSEResponse,
    close_streams,
    unless_disconnected,
)
from inferengine.entrypoints.openai.tools import check_tools
from inferengine.errors import InvalidRequestError
from inferengine.outputs import RequestOutput
from inferengine.retention import Retention


class ServingMessages:
    """Anthropic's Messages API over the server's `ServingChat` (its parsers and settings)."""

    def __init__(self, chat: ServingChat):
        self.chat = chat

    def _check_auto_tools(self, req: Any) -> None:
        """tool_choice auto needs the server's tool parser: a 400 in Anthropic's words."""
        chat = self.chat
        choice = (req.tool_choice or {}).get("type", "auto")
        if req.tools and choice == "auto" and not (chat.enable_auto_tools and chat.tool_parser):
            raise InvalidRequestError(
                'tool_choice {"type": "auto"} (the default when tools are sent) needs a server '
                "started with --enable-auto-tool-choice and --tool-call-parser (e.g. hermes); "
                'or send tool_choice {"type": "any"}, {"type": "tool", "name": ...} or '
                '{"type": "none"}.',
                param="tool_choice",
            )

    def count_tokens(self, req: CountTokensRequest) -> Response:
        """The prompt's length in tokens, rendered as `create` renders it."""
        self._check_auto_tools(req)
        chat_req = translate(req, self.chat.reasoning_parser).chat
        self.chat.check_model(chat_req.model)
        tools = check_tools(chat_req)
        messages, _ = message_dicts(chat_req.messages)
        kwargs = chat_template_kwargs(chat_req)
        if tools is not None and not (
            tools.choice == "none" and self.chat.exclude_tools_when_tool_choice_none
        ):
            kwargs["tools"] = tools.tools
        prompt = templated_prompt(self.chat.engine.input_processor, messages, **kwargs)
        return JSONResponse({"input_tokens": len(prompt["prompt_token_ids"])})

    async def create(self, req: MessagesRequest, raw: Request) -> Response:
        self._check_auto_tools(req)
        translated = translate(req, self.chat.reasoning_parser)
        chat_req = translated.chat
        prompt, params, reader, retention = self.chat.prepare(chat_req)
        num_prompt = len(prompt["prompt_token_ids"])
        msg_id = message_id()
        (stream,) = await self.chat.start(msg_id, [prompt], [params], chat_req, retention)
        reply = _Reply(self.chat, reader, BlockStream(translated.omit_thinking), retention)
        if req.stream:
            return SSEResponse(self._stream(msg_id, num_prompt, reply, stream))
        result = await unless_disconnected(raw, self._full(msg_id, num_prompt, reply, stream))
        return result if isinstance(result, Response) else JSONResponse(result)

    async def _full(
        self, msg_id: str, num_prompt: int, reply: _Reply, stream: EngineStream
    ) -> dict[str, Any]:
        final: RequestOutput | None = None
        try:
            async for output in stream:
                final = output
        finally:
            await stream.aclose()
        assert final is not None
        if final.error:
            raise InvalidRequestError(final.error)
        reply.feed(final)
        reply.blocks.close()
        return message(
            msg_id,
            self.chat.model_name,
            reply.blocks.blocks,
            *reply.stop,
            reply.usage(num_prompt, final.num_cached_tokens),
        )

    async def _stream(
        self, msg_id: str, num_prompt: int, reply: _Reply, stream: EngineStream
    ) -> AsyncGenerator[str, None]:
        started = False
        cached = 0
        try:
            async for output in stream:
                if output.error:
                    raise InvalidRequestError(output.error)
                if not started:
                    started = True
                    cached = output.num_cached_tokens
                    first = message(
                        msg_id,
                        self.chat.model_name,
                        [],
                        None,
                        None,
                        reply.usage(num_prompt, cached),
                    )
                    yield sse_event({"type": "message_start", "message": first})
                    yield sse_event({"type": "ping"})
                for event in reply.feed(output):
                    yield sse_event(event)
                if output.finished:
                    cached = output.num_cached_tokens
            for event in reply.blocks.close():
                yield sse_event(event)
            reason, sequence = reply.stop
            yield sse_event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": reply.usage(num_prompt, cached),
                }
            )
            yield sse_event({"type": "message_stop"})
        except Exception as e:
            yield stream_error_event(e)
        finally:
            await close_streams([stream])


class _Reply:
    """One reply as it comes: chat's reader, the blocks, the token count and the stop."""

    def __init__(
        self, chat: ServingChat, reader: ReplyReader, blocks: BlockStream, retention: Retention
    ):
        self.chat = chat
        self.reader = reader
        self.reply = reader.stream()
        self.blocks = blocks
        self.breakpoints = retention.breakpoints
        self.output_tokens = 0
        self.stop: tuple[str | None, str | None] = (None, None)

    def feed(self, output: RequestOutput) -> list[dict[str, Any]]:
        events = []
        for c in output.outputs:
            self.output_tokens += len(c.token_ids)
            if not c.text and c.finish_reason is None:
                continue
            delta, finish = self.reply.feed(self.chat._text(c, self.reader), c.finish_reason)
            events += self.blocks.feed(delta)
            if finish is not None:
                self.stop = stop_reason(finish, c.stop_reason)
        return events

    def usage(self, num_prompt: int, cached: int) -> dict[str, Any]:
        return usage(num_prompt, self.output_tokens, cached, self.breakpoints)
