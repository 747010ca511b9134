"""`POST /v1/responses`: a Responses request served by the chat machinery, whole or as the
Responses event stream; finished responses kept in the store for `previous_response_id`.

The request becomes a `ChatCompletionRequest` (`translate.py`) that `ServingChat.prepare`
renders, checks and turns into the engine request (one implementation of prompts, tools,
grammars and reasoning for every API); the reply is read by chat's `ReplyReader` and its deltas
become output items (`events.py`). A turn that continues a stored response renders the earlier
turns' items before its own input, in a KV session (`prompt_cache_key`, by default the first
response's id) leased for `prompt_cache_retention` (by default `SESSION_LEASE`), so its prompt
reuses the pages of the turns before it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from inferengine.entrypoints.openai.chat_reply import ReplyReader
from inferengine.entrypoints.openai.errors import error_body, internal_message
from inferengine.entrypoints.openai.responses.events import Event, OutputBuilder
from inferengine.entrypoints.openai.responses.protocol import ResponsesRequest
from inferengine.entrypoints.openai.responses.store import ResponseStore
from inferengine.entrypoints.openai.responses.translate import (
    chat_messages,
    chat_request,
    input_items,
    responses_error,
)
from inferengine.entrypoints.openai.serving_chat import ServingChat
from inferengine.entrypoints.openai.serving_engine import random_id
from inferengine.entrypoints.openai.streaming import (
    EngineStream,
    SSEResponse,
    close_streams,
    unless_disconnected,
)
from inferengine.errors import InferEngineError, InvalidRequestError, excerpt
from inferengine.outputs import RequestOutput
from inferengine.sampling_params import SamplingParams

SESSION_LEASE = "5m"  # how long a stored response's KV pages are leased for its follow-up


class ResponseNotFoundError(InferEngineError):
    """No stored response has this id (never stored, expired, deleted): OpenAI's 404."""

    status_code = 404
    error_type = "invalid_request_error"


class ServingResponses:
    def __init__(self, chat: ServingChat, store: ResponseStore):
        self.chat = chat
        self.store = store

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        req.check_fields()
        response_id = random_id("resp").replace("-", "_")
        previous = None
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise ResponseNotFoundError(
                    f"Previous response with id '{excerpt(req.previous_response_id, 64)}' not "
                    "found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
        assert req.input is not None  # check_fields
        items = input_items(req.input)
        history = [*(previous.conversation if previous else []), *items]
        # The conversation's KV session: named by its first response, unless the client names it.
        session = req.prompt_cache_key
        if session is None and previous is not None:
            session = previous.session
        elif session is None and req.stored:
            session = response_id
        lease = req.prompt_cache_retention
        if lease is None and req.stored:
            lease = SESSION_LEASE
        with responses_error():
            messages = chat_messages(req.instructions, history)
            if not messages:
                raise InvalidRequestError("input must hold at least one item.", param="input")
            chat_req = chat_request(req, messages, self.chat.reasoning_parser, session, lease)
            prompt, params, reader, retention = self.chat.prepare(chat_req)
        (stream,) = await self.chat.start(response_id, [prompt], [params], chat_req, retention)
        num_prompt = len(prompt["prompt_token_ids"])
        run = ResponseRun(self, req, response_id, params, reader, num_prompt, history, session)
        if req.stream:
            return SSEResponse(self._events(run, stream))
        result = await unless_disconnected(raw, self._whole(run, stream))
        if isinstance(result, Response):
            return result
        return JSONResponse(result)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    # ---- whole -----------------------------------------------------------------------------

    async def _whole(self, run: ResponseRun, stream: EngineStream) -> dict[str, Any]:
        try:
            async for output in stream:
                run.add(output)
        finally:
            await stream.aclose()
        return run.finish()

    # ---- streamed --------------------------------------------------------------------------

    async def _events(self, run: ResponseRun, stream: EngineStream) -> AsyncGenerator[str, None]:
        out = run.builder
        yield sse(out.event("response.created", response=run.response("in_progress")))
        yield sse(out.event("response.in_progress", response=run.response("in_progress")))
        try:
            async for output in stream:
                run.add(output)
                for event in out.take():
                    yield sse(event)
            response = run.finish()
            for event in out.take():
                yield sse(event)
            kind = "response.completed"
            if response["status"] == "incomplete":
                kind = "response.incomplete"
            yield sse(out.event(kind, response=response))
        except Exception as e:
            for event in run.failed(e):
                yield sse(event)
        finally:
            await close_streams([stream])


def _not_found(response_id: str) -> ResponseNotFoundError:
    return ResponseNotFoundError(
        f"Response with id '{excerpt(response_id, 64)}' not found.", param="response_id"
    )


def sse(event: Event) -> str:
    """One Responses event: its type as the SSE event name, the event as the data line."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    for c in "\x1c\x1d\x1e\x85\u2028\u2029":  # line breaks to some readers: escaped
        data = data.replace(c, f"\\u{ord(c):04x}")
    return f"event: {event['type']}\ndata: {data}\n\n"


class ResponseRun:
    """One response being generated: its reply read through chat's `ReplyReader` into output
    items, its token counts, and the response object at each stage."""

    def __init__(
        self,
        serving: ServingResponses,
        req: ResponsesRequest,
        response_id: str,
        params: SamplingParams,
        reader: ReplyReader,
        num_prompt: int,
        history: list[dict[str, Any]] | None = None,
        session: str | None = None,
    ):
        self.serving = serving
        self.chat = serving.chat
        self.req = req
        self.id = response_id
        self.params = params
        self.reader = reader
        self.reply = reader.stream()
        self.builder = OutputBuilder()
        self.num_prompt = num_prompt
        self.token_ids: list[int] = []
        self.num_cached = 0
        self.finish_reason: str | None = None
        self.created_at = int(time.time())
        self.history = history or []  # the conversation this response answers
        self.session = session or response_id

    def add(self, output: RequestOutput) -> None:
        if output.error:
            raise InvalidRequestError(output.error)
        for c in output.outputs:
            self.token_ids.extend(c.token_ids)
            if not c.text and not c.token_ids and c.finish_reason is None:
                continue
            delta, finish_reason = self.reply.feed(self.chat._text(c, self.reader), c.finish_reason)
            self.builder.feed(delta)
            if c.finish_reason is not None:
                self.finish_reason = finish_reason
        if output.finished:
            self.num_cached = output.num_cached_tokens

    def finish(self) -> dict[str, Any]:
        """The finished response (stored, unless `store` is false)."""
        status = "incomplete" if self.finish_reason in ("length", "abort") else "completed"
        self.builder.close(status)
        response = self.response(status)
        if status == "incomplete":
            reason = "max_output_tokens" if self.finish_reason == "length" else None
            response["incomplete_details"] = {"reason": reason}
        response["completed_at"] = int(time.time())
        response["usage"] = self.usage()
        if self.req.stored:
            self.serving.store.put(response, self.history, self.session)
        return response

    def failed(self, error: BaseException) -> list[Event]:
        """The events that end a stream that failed: `error`, then `response.failed`."""
        if isinstance(error, InferEngineError):
            body = error_body(error.message, error.error_type, error.status_code, error.param)
        else:
            body = error_body(internal_message(error), "internal_error", 500)
        detail = body["error"]
        code = "server_error" if detail["type"] == "internal_error" else detail["type"]
        response = self.response("failed")
        response["error"] = {"code": code, "message": detail["message"]}
        out = self.builder
        return [
            out.event("error", code=code, message=detail["message"], param=detail["param"]),
            out.event("response.failed", response=response),
        ]

    def usage(self) -> dict[str, Any]:
        num_output = len(self.token_ids)
        return {
            "input_tokens": self.num_prompt,
            "input_tokens_details": {"cached_tokens": self.num_cached},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
            "total_tokens": self.num_prompt + num_output,
        }

    def _reasoning_tokens(self) -> int:
        """The reply's tokens up to its `</think>` token (the whole reply when it never closed
        its reasoning); the reasoning text's token count where `</think>` is no one token."""
        texts = [
            c["text"] for i in self.builder.items if i["type"] == "reasoning" for c in i["content"]
        ]
        if not texts:
            return 0
        end_id = self.chat.reasoning_token_ids[1]
        if end_id is not None and end_id in self.token_ids:
            return self.token_ids.index(end_id) + 1
        if all(i["type"] == "reasoning" for i in self.builder.items):
            return len(self.token_ids)
        counted = len(self.chat.tokenizer.encode("".join(texts), add_special_tokens=False))
        return min(counted, len(self.token_ids))

    def response(self, status: str) -> dict[str, Any]:
        """The response object as it stands (OpenAI's fields; what was asked, echoed)."""
        req, params = self.req, self.params
        text_format = (req.text or {}).get("format") or {"type": "text"}
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if req.tools else "none"
        reasoning = (
            req.reasoning.model_dump(exclude={"generate_summary"}) if req.reasoning else None
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "metadata": req.metadata or {},
            "model": self.chat.model_name,
            "output": [dict(item) for item in self.builder.items]
            if status != "in_progress"
            else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention,
            "reasoning": reasoning,
            "safety_identifier": req.safety_identifier,
            "service_tier": "default",
            "store": req.stored,
            "temperature": params.temperature,
            "text": {"format": text_format, "verbosity": "medium"},
            "tool_choice": choice,
            "tools": [_tool(t) for t in req.tools or []],
            "top_logprobs": 0,
            "top_p": params.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
        }


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as the response echoes it: `strict` true unless sent false."""
    return {**tool, "strict": tool.get("strict") is not False}
