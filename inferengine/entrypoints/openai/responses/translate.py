"""A Responses request as the chat completion request the chat machinery serves: input items to
chat messages, function tools and `tool_choice` to chat's shapes, `text.format` to
`response_format`, `reasoning` to the template's thinking switch; and chat's error params back
to the Responses fields they came from.

Only shapes are checked here; what chat checks (tool schemas, grammars, context length, the
tool-call parser) it checks once for both APIs, and `responses_error` renames its params.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from inferengine.entrypoints.openai.errors import validation_message
from inferengine.entrypoints.openai.protocol import ChatCompletionRequest
from inferengine.entrypoints.openai.reasoning_parsers import ReasoningParser
from inferengine.entrypoints.openai.responses.protocol import EXTENSION_FIELDS, ResponsesRequest
from inferengine.errors import InvalidRequestError, excerpt

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_NAMED = '{"type": "function", "name": "my_function"}'


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return value


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for `instructions` (a system message first) and the conversation's items,
    in order: messages by role ("developer" is "system"), a turn's `function_call` items as one
    assistant message's `tool_calls` (after its text, if any), a `function_call_output` as a
    "tool" message, a `reasoning` item as the next assistant message's `reasoning_content`."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    reasoning: str | None = None
    turn_open = False  # the last message is an assistant turn that calls may join

    def assistant(content: str | None) -> dict[str, Any]:
        nonlocal reasoning
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        messages.append(message)
        return message

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object (an input item).", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise InvalidRequestError(
                    f"{where}.role must be one of user, assistant, system or developer; got "
                    f"{excerpt(repr(item.get('role')), 64)}.",
                    param=f"{where}.role",
                )
            content = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                assistant(content)
            else:
                messages.append({"role": role, "content": content})
            turn_open = role == "assistant"
        elif kind == "function_call":
            call = _call(item, where)
            last = messages[-1] if turn_open else assistant(None)
            last.setdefault("tool_calls", []).append(call)
            turn_open = True
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = _text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            turn_open = False
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        elif kind == "item_reference":
            raise InvalidRequestError(
                f"{where}: item references are not supported; send the item itself, or "
                "continue a stored response with previous_response_id.",
                param=f"{where}.type",
            )
        else:
            raise InvalidRequestError(
                f"{where}.type {excerpt(repr(kind), 64)} is not supported; input items are "
                "messages, function_call, function_call_output and reasoning.",
                param=f"{where}.type",
            )
    return messages


def _text(content: Any, where: str) -> str:
    """A message's (or a tool output's) text: a string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{where} must be a string or a list of content parts.", param=where
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind)  # type: ignore[arg-type]
        if key is None or not isinstance(part.get(key), str):
            raise InvalidRequestError(
                f"{where}[{j}]: content parts of type {excerpt(repr(kind), 64)} are not "
                "supported (InferEngine serves text-only models); send input_text parts.",
                param=f"{where}[{j}].type",
            )
        texts.append(part[key])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(
            f"{where}.{key} is required: a non-empty string.", param=f"{where}.{key}"
        )
    return value


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise InvalidRequestError(
            f"{where}.arguments is required: the call's arguments as a JSON string.",
            param=f"{where}.arguments",
        )
    return {
        "id": _string(item, "call_id", where),
        "type": "function",
        "function": {"name": _string(item, "name", where), "arguments": arguments},
    }


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """An earlier reasoning item's text (its reasoning_text parts, else its summary)."""
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise InvalidRequestError(f"{where}.{key} must be a list.", param=f"{where}.{key}")
        texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if texts:
            return "\n".join(texts)
    return ""


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape; a function is strict unless it says `"strict": false`
    (OpenAI's default on /v1/responses). Any other tool type is a 400."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(
                f'{where} must be an object: {{"type": "function", "name": ...}}.', param=where
            )
        if tool.get("type") != "function":
            raise InvalidRequestError(
                f"{where}.type {excerpt(repr(tool.get('type')), 64)} is not supported: only "
                "function tools are (this server runs no hosted tools such as web_search, "
                "file_search or code_interpreter).",
                param=f"{where}.type",
            )
        unknown = sorted(set(tool) - _TOOL_KEYS)
        if unknown:
            name = excerpt(unknown[0], 64)
            raise InvalidRequestError(
                f"Unknown parameter: '{where}.{name}'.",
                param=f"{where}.{name}",
                code="unknown_parameter",
            )
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        function.setdefault("strict", True)
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice  # chat checks the names ("none", "auto", "required")
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(
                f"tool_choice.name is required: {_NAMED}.", param="tool_choice.name"
            )
        return {"type": "function", "function": {"name": name}}
    raise InvalidRequestError(
        f"tool_choice of type {excerpt(repr(kind), 64)} is not supported; send 'none', 'auto', "
        f"'required' or a function: {_NAMED}.",
        param="tool_choice.type",
    )


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`; `text.verbosity` other than "medium" is a 400."""
    if not text:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        name = excerpt(unknown[0], 64)
        raise InvalidRequestError(
            f"Unknown parameter: 'text.{name}'.", param=f"text.{name}", code="unknown_parameter"
        )
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidRequestError(
            "text.verbosity is not supported: the model's replies have no verbosity setting "
            '(send "medium" or leave it out).',
            param="text.verbosity",
        )
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise InvalidRequestError(
            f"text.format type {excerpt(repr(kind), 64)} is not supported; use 'text', "
            "'json_object' or 'json_schema'.",
            param="text.format.type",
        )
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def thinking_kwargs(req: ResponsesRequest, parser: ReasoningParser | None) -> dict[str, Any]:
    """The chat template variables `reasoning` asks for. The model has no effort dial: effort
    "medium" (OpenAI's default) asks for nothing; "none" turns thinking off where the server's
    reasoning parser knows the template's switch; other efforts, and summaries other than
    "auto" (a summary is never written), are a 400."""
    reasoning = req.reasoning
    if reasoning is None:
        return {}
    summary = reasoning.summary or reasoning.generate_summary
    if summary not in (None, "auto"):
        raise InvalidRequestError(
            f"reasoning.summary {excerpt(repr(summary), 64)} is not supported: this server "
            "returns the model's reasoning text itself (with --reasoning-parser), never a "
            'summary; send "auto" or leave it out.',
            param="reasoning.summary",
        )
    effort = reasoning.effort
    if effort in (None, "medium"):
        return {}
    switch = {"enable_thinking": False}
    if effort == "none" and parser is not None and parser.thinking_off(switch):
        return switch
    how = (
        f'effort "none" turns thinking off ({parser.thinking_switch})'
        if parser is not None and parser.thinking_switch
        else "this server cannot turn the model's thinking off (its --reasoning-parser has no switch)"
    )
    raise InvalidRequestError(
        f"reasoning.effort {excerpt(repr(effort), 64)} is not supported: the model has no "
        f'effort setting; "medium" (the default) reasons as the model does, and {how}.',
        param="reasoning.effort",
    )


def chat_request(
    req: ResponsesRequest,
    messages: list[dict[str, Any]],
    parser: ReasoningParser | None,
    session: str | None,
    retention: str | None,
) -> ChatCompletionRequest:
    """The chat completion request that serves `req`, whose KV pages the session `session`
    keeps for `retention` (`prompt_cache_retention`'s values)."""
    template_kwargs = dict(req.chat_template_kwargs or {})
    template_kwargs.update(thinking_kwargs(req, parser))
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format(req.text),
        "stream": bool(req.stream),
        "prompt_cache_key": session,
        "prompt_cache_retention": retention,
        "chat_template_kwargs": template_kwargs or None,
    }
    for name in EXTENSION_FIELDS:
        if name != "chat_template_kwargs":
            fields[name] = getattr(req, name)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        message, param = validation_message(e)
        raise InvalidRequestError(rename(message), param=param and rename(param)) from None


# Chat's params (and the words of its messages) to the Responses fields they came from.
_RENAMES = (
    (re.compile(r"\bresponse_format\.json_schema\."), "text.format."),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"),
    (re.compile(r"\btool_choice\.function\."), "tool_choice."),
    (re.compile(r"\bmax_(?:completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"\bmessages\[\d+\][\w.\[\]]*|\bmessages\b"), "input"),
)


def rename(text: str) -> str:
    for pattern, replacement in _RENAMES:
        text = pattern.sub(replacement, text)
    return text


@contextmanager
def responses_error() -> Iterator[None]:
    """Chat's 400s (and pydantic's) with their params and words renamed to the Responses
    request's fields."""
    try:
        yield
    except InvalidRequestError as e:
        param = rename(e.param) if e.param is not None else None
        raise InvalidRequestError(rename(e.message), param=param, code=e.code) from e
