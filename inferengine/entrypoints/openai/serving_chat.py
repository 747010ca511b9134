"""`POST /v1/chat/completions`: messages through the chat template to replies, streamed or not.

Tools (`tools.py`) go to the chat template; a forced tool_choice, or "auto" with strict tools
(merged with the request's `response_format`, if any), becomes structured output, which with a
reasoning parser starts after `</think>`; the reply is read by `chat_reply.py` (reasoning split
off, tool calls parsed from the content after it, their arguments streamed as they are written).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from inferengine.entrypoints.cache_breakpoints import cache_breakpoints, take_cache_control
from inferengine.entrypoints.chat_messages import template_messages, templated_prompt
from inferengine.entrypoints.openai.chat_reply import ForcedCalls, ReplyReader
from inferengine.entrypoints.openai.errors import stream_error_event
from inferengine.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
)
from inferengine.entrypoints.openai.reasoning_parsers import (
    END,
    REASONING_PARSERS,
    START,
    ReasoningParser,
)
from inferengine.entrypoints.openai.serving_engine import (
    OpenAIServing,
    RequestLimits,
    make_usage,
    random_id,
    sse,
)
from inferengine.entrypoints.openai.streaming import (
    SSE_DONE,
    EngineStream,
    SSEResponse,
    close_streams,
    unless_disconnected,
)
from inferengine.entrypoints.openai.structured_outputs import asking_fields
from inferengine.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser
from inferengine.entrypoints.openai.tools import ToolRequest, check_tools
from inferengine.errors import ConfigError, InvalidRequestError
from inferengine.outputs import CompletionOutput, RequestOutput
from inferengine.retention import Retention
from inferengine.sampling_params import RequestOutputKind, SamplingParams


def message_dicts(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], dict[int, float]]:
    """Messages as the chat template wants them (`chat_messages.template_messages`: null content
    "", text parts joined, tool call arguments as dicts), and the lease in seconds of each
    message marked with `cache_control`."""
    dicts, leases = take_cache_control([m.model_dump(exclude_none=True) for m in messages])
    return template_messages(dicts), leases


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
    """Chat replies. `tool_parser` (with `enable_auto_tools`) serves tool_choice "auto";
    `reasoning_parser` splits the reasoning off replies; both are vLLM's names (`--tool-call-parser`,
    `--reasoning-parser`)."""

    def __init__(
        self,
        engine: Any,
        log_requests: bool = False,
        limits: RequestLimits | None = None,
        *,
        enable_auto_tools: bool = False,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        exclude_tools_when_tool_choice_none: bool = False,
    ):
        super().__init__(engine, log_requests, limits)
        for kind, name, table in (
            ("tool call", tool_parser, TOOL_PARSERS),
            ("reasoning", reasoning_parser, REASONING_PARSERS),
        ):
            if name is not None and name not in table:
                raise ConfigError(
                    f"unknown {kind} parser {name!r}; choose one of {', '.join(table)}."
                )
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser: ToolParser | None = TOOL_PARSERS[tool_parser]() if tool_parser else None
        self.reasoning_parser: ReasoningParser | None = (
            REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
        )
        # The tokens that open and close a reasoning block, where the tokenizer has each tag as
        # one token: the grammar of structured output starts after the closing one.
        self.reasoning_token_ids: tuple[int | None, int | None] = (None, None)
        if self.reasoning_parser is not None:
            self.reasoning_token_ids = (
                single_token_id(self.tokenizer, START),
                single_token_id(self.tokenizer, END),
            )
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none

    async def create(
        self, req: ChatCompletionRequest, raw: Request
    ) -> Response | ChatCompletionResponse:
        prompt, params, reader, retention = self.prepare(req)
        num_prompt = len(prompt["prompt_token_ids"])
        request_id = random_id("chatcmpl")
        streams = await self.start(request_id, [prompt], [params], req, retention)
        if req.stream:
            return SSEResponse(self._stream(request_id, req, num_prompt, reader, streams[0]))
        return await unless_disconnected(
            raw, self._full(request_id, num_prompt, reader, streams[0])
        )

    def prepare(
        self, req: ChatCompletionRequest
    ) -> tuple[dict[str, Any], SamplingParams, ReplyReader, Retention]:
        """Check the request; its templated prompt, `SamplingParams`, `ReplyReader` (how to read
        the reply: logprobs, reasoning, tool calls) and `Retention` (with the breakpoints of its
        `cache_control` marks). Also used by run-batch."""
        self.check_model(req.model)
        self.check_fields(req)
        self._check_unsupported(req)
        tools = check_tools(req)
        self._check_auto_tools(tools)
        retention = self.retention(req)
        messages, leases = message_dicts(req.messages)
        template_kwargs = chat_template_kwargs(req)
        if tools is not None and not (
            tools.choice == "none" and self.exclude_tools_when_tool_choice_none
        ):
            template_kwargs["tools"] = tools.tools
        processor = self.engine.input_processor
        prompt = templated_prompt(processor, messages, **template_kwargs)
        if leases:
            breakpoints = cache_breakpoints(
                processor, messages, leases, prompt["prompt_token_ids"], template_kwargs
            )
            retention = dataclasses.replace(retention, breakpoints=tuple(breakpoints))
        num_prompt = len(prompt["prompt_token_ids"])
        # max_completion_tokens wins (OpenAI's newer name); 0 is a value, not "unset"
        field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = self.resolve_max_tokens(
            getattr(req, field), num_prompt, self.default_max_tokens, "messages", field
        )
        num_top = None
        if req.logprobs:
            num_top = req.top_logprobs or 0
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = self.sampling_params(req, max_tokens, kind, logprobs=num_top)
        reader = self._reader(req, tools, params, num_top)
        self._start_grammar_after_reasoning(req, params, tools, template_kwargs)
        return prompt, params, reader, retention

    def _reader(
        self,
        req: ChatCompletionRequest,
        tools: ToolRequest | None,
        params: SamplingParams,
        num_top: int | None,
    ) -> ReplyReader:
        """How to read the reply; a forced tool choice sets `params`' structured output, and a
        parser whose tags are special tokens has them decoded."""
        reader = ReplyReader(num_top=num_top, reasoning=self.reasoning_parser)
        parser = self.tool_parser
        if parser is not None:
            reader = dataclasses.replace(reader, make_call_id=parser.make_call_id)
        if tools is not None and tools.forced:
            self._check_structured_conflict(req, tools)
            params.structured_outputs = tools.structured_outputs()
            return dataclasses.replace(reader, forced=ForcedCalls(tools.name))
        if tools is None or tools.choice != "auto" or parser is None:
            return reader
        reader = dataclasses.replace(
            reader,
            tool_parser=parser,
            max_calls=None if tools.parallel else 1,
            strip_stop_token=parser.keeps_special_tokens and params.skip_special_tokens,
        )
        if parser.keeps_special_tokens:
            params.skip_special_tokens = False
        # "auto" with strict tools: their calls held by a grammar, which merges the request's
        # own structured output (`response_format`) as the one other reply it allows
        strict = tools.strict_outputs(parser, self.tokenizer, answer=params.structured_outputs)
        if strict is not None:
            params.structured_outputs = strict
        return reader

    @staticmethod
    def _check_unsupported(req: ChatCompletionRequest) -> None:
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError(
                "top_logprobs needs logprobs to be true.", param="top_logprobs"
            )

    def _check_auto_tools(self, tools: ToolRequest | None) -> None:
        if (
            tools is not None
            and tools.choice == "auto"
            and not (self.enable_auto_tools and self.tool_parser is not None)
        ):
            raise InvalidRequestError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                "be set: start the server with them (e.g. --enable-auto-tool-choice "
                '--tool-call-parser hermes), or send tool_choice "required", a named function or '
                '"none". (tool_choice is "auto" when tools are sent without it.)',
                param="tool_choice",
            )

    @staticmethod
    def _check_structured_conflict(req: ChatCompletionRequest, tools: ToolRequest) -> None:
        """A forced tool choice with other structured output: a 400 (the reply is a call)."""
        fields = asking_fields(req)
        if fields:
            raise InvalidRequestError(
                f"{fields[0]} and tool_choice {_describe_choice(tools)} both constrain the reply "
                "(the forced tool choice is itself structured output); send only one of them.",
                param=fields[0],
            )

    def _start_grammar_after_reasoning(
        self,
        req: ChatCompletionRequest,
        params: SamplingParams,
        tools: ToolRequest | None,
        template_kwargs: dict[str, Any],
    ) -> None:
        """A reasoning model writes its `<think>` block first, so its structured output (a
        forced tool choice too) starts after `</think>`: the engine leaves the reply free until
        that token. A request that turned thinking off is constrained from the first token; a
        tokenizer without a single `</think>` token cannot tell the engine where, a 400."""
        parser = self.reasoning_parser
        constrained = params.structured_outputs
        if parser is None or constrained is None or parser.thinking_off(template_kwargs):
            return
        start_id, end_id = self.reasoning_token_ids
        if end_id is not None:
            params.structured_outputs = dataclasses.replace(
                constrained, reasoning_start_token_id=start_id, reasoning_end_token_id=end_id
            )
            return
        if tools is not None and tools.forced:
            field, what = "tool_choice", f"tool_choice {_describe_choice(tools)}"
        elif tools is not None and tools.choice == "auto" and tools.strict_indexes:
            field = f"tools[{tools.strict_indexes[0]}].function.strict"
            what = f"the strict tool tools[{tools.strict_indexes[0]}]"
        else:
            field = asking_fields(req)[0]
            what = field
        hint = (
            f", or turn thinking off with {parser.thinking_switch}"
            if parser.thinking_switch
            else ""
        )
        raise InvalidRequestError(
            f"{what} asks for structured output, which with --reasoning-parser {parser.name} "
            f"starts after the reasoning block; but this model's tokenizer has no single {END} "
            f"token, so the grammar cannot start after the reasoning. Leave out {field}{hint}.",
            param=field,
        )

    def _logprobs(self, completion: CompletionOutput, num_top: int | None) -> ChatLogprobs | None:
        if num_top is None:
            return None
        return self.chat_logprobs(completion.token_ids, completion.logprobs or [], num_top)

    def _text(self, completion: CompletionOutput, reader: ReplyReader) -> str:
        """The completion's (new) text, less the stop token's text where special tokens were
        decoded only for the tool parser."""
        text = completion.text
        if (
            reader.strip_stop_token
            and completion.finish_reason == "stop"
            and not isinstance(completion.stop_reason, str)
            and completion.token_ids
        ):
            stop_text = self.token_str(completion.token_ids[-1])
            if stop_text and text.endswith(stop_text):
                text = text[: -len(stop_text)]
        return text

    # ---- non-streaming ---------------------------------------------------------------------

    async def _full(
        self, request_id: str, num_prompt: int, reader: ReplyReader, stream: EngineStream
    ) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        try:
            async for output in stream:
                final = output
        finally:
            await stream.aclose()
        assert final is not None
        return self.response(request_id, num_prompt, reader, final)

    def response(
        self, request_id: str, num_prompt: int, reader: ReplyReader, final: RequestOutput
    ) -> ChatCompletionResponse:
        """The non-streaming reply from the final output (also used by run-batch)."""
        if final.error:
            raise InvalidRequestError(final.error)
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            message, finish_reason = reader.message(self._text(c, reader), c.finish_reason)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(c, reader.num_top),
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=make_usage(num_prompt, completion_tokens, final.num_cached_tokens),
            kv_transfer_params=final.kv_transfer_params,
        )

    # ---- streaming -------------------------------------------------------------------------

    async def _stream(
        self,
        request_id: str,
        req: ChatCompletionRequest,
        num_prompt: int,
        reader: ReplyReader,
        stream: EngineStream,
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, choices=choices
            )

        completion_tokens = cached = 0
        replies = [reader.stream() for _ in range(req.n)]
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
                    logprobs = self._logprobs(c, reader.num_top) if c.token_ids else None
                    # A chunk for every new token, even one with no text yet (as vLLM sends).
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    delta, finish_reason = replies[c.index].feed(
                        self._text(c, reader), c.finish_reason
                    )
                    choice = ChatStreamChoice(
                        index=c.index,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=finish_reason,
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


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of the vocabulary token whose text is exactly `text`; None when there is none (the
    text takes several tokens, or maps to the unknown token)."""
    token_id = tokenizer.convert_tokens_to_ids(text)
    if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != text:
        return None
    return token_id


def _describe_choice(tools: ToolRequest) -> str:
    return f"naming {tools.name!r}" if tools.name is not None else repr(tools.choice)
