"""A Messages request checked and translated into the chat machinery's `ChatCompletionRequest`.

Anthropic's shapes map onto chat's as follows (the chat template, tool grammars, reasoning parser
and KV leases are then chat's own, see `serving_chat.py`):

    system (string or text blocks)      a "system" message (blocks as text parts)
    user text blocks                    a "user" message of text parts
    user tool_result blocks             a "tool" message each ({tool_call_id, content}), in order;
                                        is_error true prefixes the content with "Error: "
    assistant text / tool_use blocks    one "assistant" message: text parts and tool_calls
    assistant thinking blocks           its reasoning_content
    a last assistant message            a prefill: continue_final_message
    tools[i] {name, description,        function tools {name, description, parameters, strict}
      input_schema, strict}
    tool_choice auto | any | tool | none  "auto" | "required" | the named function | "none";
                                        disable_parallel_tool_use -> parallel_tool_calls false
    cache_control on a block            a mark on its text part, or on its chat message (tool_use,
                                        tool_result); on a tool: on the first message (tools are
                                        rendered ahead of the conversation); top-level: on the
                                        last message
    thinking enabled | adaptive |       the reasoning parser's thinking blocks; the template's
      disabled                          enable_thinking switch where the parser has one
    output_config.format json_schema    structured output (`structured_outputs.json`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inferengine.entrypoints.anthropic.options import (
    chat_tool_choice,
    chat_tools,
    check_keys,
    output_format,
    thinking_kwargs,
)
from inferengine.entrypoints.anthropic.protocol import (
    REFUSED_FIELDS,
    MessagesRequest,
    PromptFields,
    refused_fields,
)
from inferengine.entrypoints.cache_breakpoints import parse_cache_control
from inferengine.entrypoints.openai.protocol import ChatCompletionRequest
from inferengine.entrypoints.openai.reasoning_parsers import ReasoningParser
from inferengine.errors import InvalidRequestError

MAX_CACHE_BREAKPOINTS = 4  # Anthropic's limit on blocks with cache_control
_TEXT_KEYS = {"type", "text", "cache_control", "citations"}
_BLOCK_KEYS = {
    "text": _TEXT_KEYS,
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
}
_NOT_YET = {
    "image": "image content blocks are not supported yet (InferEngine serves text-only models)",
    "document": "document content blocks are not supported yet; send their text",
    "redacted_thinking": "redacted_thinking blocks cannot be read here (they are encrypted for "
    "Anthropic's models); leave them out",
}


@dataclass(frozen=True)
class Translated:
    """A Messages request as a chat request, and what the reply must do besides."""

    chat: ChatCompletionRequest
    omit_thinking: bool = False  # thinking.display "omitted": thinking blocks without their text


class _Marks:
    """The request's cache_control marks, each checked where it stands, and their count."""

    def __init__(self) -> None:
        self.count = 0

    def check(self, mark: Any, where: str) -> float:
        self.count += 1
        if self.count > MAX_CACHE_BREAKPOINTS:
            raise InvalidRequestError(
                f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be "
                f"provided; {where} is one more.",
                param=where,
            )
        return parse_cache_control(mark, where)

    def on_message(self, message: dict[str, Any], mark: Any, where: str) -> None:
        """`mark` on a whole chat message, where the longer of two leases wins."""
        seconds = self.check(mark, where)
        held = message.get("cache_control")
        if held is None or parse_cache_control(held) < seconds:
            message["cache_control"] = mark


def _text_part(block: dict[str, Any], where: str, marks: _Marks | None) -> dict[str, Any]:
    """A text block as a chat text part; its cache_control checked (by the caller when `marks`
    is None)."""
    check_keys(block, _TEXT_KEYS, where)
    if not isinstance(block.get("text"), str):
        raise InvalidRequestError(f"{where}.text: Input should be a valid string", param=where)
    if block.get("citations"):
        raise InvalidRequestError(
            f"{where}.citations: citations are not supported; leave them out.", param=where
        )
    part: dict[str, Any] = {"type": "text", "text": block["text"]}
    if block.get("cache_control") is not None:
        if marks is not None:
            marks.check(block["cache_control"], f"{where}.cache_control")
        part["cache_control"] = block["cache_control"]
    return part


def _block_type(block: Any, where: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(block, dict):
        raise InvalidRequestError(f"{where}: Input should be an object", param=where)
    kind = block.get("type")
    if kind in allowed:
        return kind
    if kind in _NOT_YET:
        raise InvalidRequestError(f"{where}: {_NOT_YET[kind]}.", param=f"{where}.type")
    raise InvalidRequestError(
        f"{where}.type: content block type {kind!r} is not supported here; send one of "
        f"{', '.join(allowed)}.",
        param=f"{where}.type",
    )


def system_message(system: str | list[dict[str, Any]], marks: _Marks) -> dict[str, Any]:
    if isinstance(system, str):
        return {"role": "system", "content": system}
    parts = []
    for j, block in enumerate(system):
        _block_type(block, f"system.{j}", ("text",))
        parts.append(_text_part(block, f"system.{j}", marks))
    return {"role": "system", "content": parts}


def _tool_message(block: dict[str, Any], where: str, marks: _Marks) -> dict[str, Any]:
    check_keys(block, _BLOCK_KEYS["tool_result"], where)
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError(f"{where}.tool_use_id: Field required", param=where)
    content = block.get("content")
    message: dict[str, Any] = {"role": "tool", "tool_call_id": call_id}
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        texts = []
        for k, inner in enumerate(content):
            inner_where = f"{where}.content.{k}"
            _block_type(inner, inner_where, ("text",))
            part = _text_part(inner, inner_where, None)
            texts.append(part["text"])
            if "cache_control" in part:  # the tool message is one piece of the prompt
                marks.on_message(message, part["cache_control"], f"{inner_where}.cache_control")
        text = "\n".join(texts)
    else:
        raise InvalidRequestError(
            f"{where}.content: Input should be a string or a list of text blocks", param=where
        )
    if block.get("is_error"):
        text = f"Error: {text}"
    message["content"] = text
    if block.get("cache_control") is not None:
        marks.on_message(message, block["cache_control"], f"{where}.cache_control")
    return message


def _user_messages(content: list[Any], i: int, marks: _Marks) -> list[dict[str, Any]]:
    """One Anthropic user turn: its tool results as "tool" messages, its text as "user" ones."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"messages.{i}.content.{j}"
        kind = _block_type(block, where, ("text", "tool_result"))
        if kind == "text":
            parts.append(_text_part(block, where, marks))
            continue
        if parts:
            out.append({"role": "user", "content": parts})
            parts = []
        out.append(_tool_message(block, where, marks))
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_message(content: list[Any], i: int, marks: _Marks) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant"}
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(content):
        where = f"messages.{i}.content.{j}"
        kind = _block_type(block, where, ("text", "tool_use", "thinking"))
        if kind == "text":
            parts.append(_text_part(block, where, marks))
            continue
        check_keys(block, _BLOCK_KEYS[kind], where)
        if kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise InvalidRequestError(f"{where}.thinking: Field required", param=where)
            reasoning.append(block["thinking"])
            continue
        for key in ("id", "name"):
            if not isinstance(block.get(key), str) or not block[key]:
                raise InvalidRequestError(f"{where}.{key}: Field required", param=where)
        if not isinstance(block.get("input"), dict):
            raise InvalidRequestError(
                f"{where}.input: Input should be a valid dictionary", param=where
            )
        function = {"name": block["name"], "arguments": block["input"]}
        calls.append({"id": block["id"], "type": "function", "function": function})
        if block.get("cache_control") is not None:
            marks.on_message(message, block["cache_control"], f"{where}.cache_control")
    message["content"] = parts
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def chat_messages(req: PromptFields, marks: _Marks) -> list[dict[str, Any]]:
    out = [system_message(req.system, marks)] if req.system is not None else []
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            out.extend(_user_messages(message.content, i, marks))
        else:
            out.append(_assistant_message(message.content, i, marks))
    return out


def translate(req: PromptFields, parser: ReasoningParser | None) -> Translated:
    """The chat request that serves `req` (a `MessagesRequest`, or the prompt fields of a
    `count_tokens` request); a 400 in Anthropic's words for what cannot be served."""
    for name in refused_fields(req):
        raise InvalidRequestError(f"{name}: not supported: {REFUSED_FIELDS[name]}.", param=name)
    marks = _Marks()
    messages = chat_messages(req, marks)
    tools, tool_marks = chat_tools(req.tools) if req.tools is not None else (None, [])
    for mark, where in tool_marks:
        marks.on_message(messages[0], mark, where)
    if req.cache_control is not None:
        marks.on_message(messages[-1], req.cache_control, "cache_control")
    choice, parallel = chat_tool_choice(req.tool_choice)
    generating = isinstance(req, MessagesRequest)
    max_tokens = req.max_tokens if generating else None
    template_kwargs, omit = thinking_kwargs(req.thinking, parser, max_tokens)
    structured = output_format(req.output_config)
    if structured is not None and choice not in (None, "auto", "none"):
        raise InvalidRequestError(
            "output_config.format and a tool_choice that forces a tool both constrain the reply; "
            "send only one of them.",
            param="output_config.format",
        )
    prefill = req.messages[-1].role == "assistant"
    fields: dict[str, Any] = dict(
        model=req.model,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        chat_template_kwargs=template_kwargs or None,
        structured_outputs=structured,
    )
    if isinstance(req, MessagesRequest):
        fields |= dict(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stream=req.stream,
            user=req.metadata.user_id if req.metadata is not None else None,
        )
    return Translated(ChatCompletionRequest(**fields), omit)
