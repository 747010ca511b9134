"""Chat messages as chat templates read them, and a clear 400 when a template cannot render the
tool turns among them. The server (chat and /tokenize) and `LLM.chat` both go through here.

The messages are handed over as vLLM hands them: a null `content` (an assistant turn that only
calls tools, exactly as OpenAI's SDK sends its reply back) is "", a list of text parts is their
texts joined by newlines, an assistant's `tool_calls` carry their arguments as dicts (templates
write them with `tojson`), and a null or empty `tool_calls` is left out (Llama 3.1's template asks
`'tool_calls' in message`). `name`, `tool_call_id` and other fields pass through as sent.

A conversation with tool turns (an assistant's `tool_calls`, a `role: "tool"` result) meets a
template that cannot render them in two ways: the template never reads `tool_calls`, so the calls
would silently vanish from the prompt; or it raises (Gemma's "roles must alternate", Mistral's
9-character call ids, ...). Either is a 400 saying so and what to send instead, not a bare Jinja
error.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from inferengine.engine.input_processor import InputProcessor
from inferengine.entrypoints.chat_content import text_parts
from inferengine.entrypoints.openai.tools import template_tool_calls
from inferengine.errors import InvalidRequestError

_COMMENT = re.compile(r"\{#.*?#\}", re.DOTALL)
_WHAT_TO_DO = (
    "send a chat template that renders tool calls and tool results as chat_template (the "
    "tool-use template of the model's family, such as Qwen2.5's, Llama 3.1's or Mistral's), or "
    "serve the model with a tokenizer_config.json whose chat_template has tool support"
)


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` as chat templates read them (see the module docstring); a 400 naming
    the field for a content that is neither text nor text parts, or a malformed tool call."""
    out = []
    for index, message in enumerate(messages):
        item = dict(message)
        content = item.get("content")
        texts = text_parts(content)
        if texts is not None:
            item["content"] = "\n".join(texts)
        elif content is None:
            item["content"] = ""
        elif not isinstance(content, str):
            raise InvalidRequestError(
                f"messages[{index}].content must be a string, a list of text parts or null; got "
                f"{type(content).__name__}.",
                param=f"messages[{index}].content",
            )
        template_tool_calls(item, index)
        out.append(item)
    return out


def templated_prompt(
    processor: InputProcessor, messages: list[dict[str, Any]], **template_kwargs: Any
) -> dict[str, Any]:
    """`processor.chat_prompt(messages, ...)` for messages from `template_messages`, with a 400
    that says the template cannot render tool turns where it cannot."""
    calls_at = [i for i, m in enumerate(messages) if m.get("tool_calls")]
    results_at = [i for i, m in enumerate(messages) if m.get("role") == "tool"]
    source = _template_source(processor, template_kwargs)
    if calls_at and source is not None and not _reads_tool_calls(source):
        where = f"messages[{calls_at[0]}].tool_calls"
        raise InvalidRequestError(
            f"{where}: this chat template never reads tool_calls, so the earlier tool calls "
            f"would be left out of the prompt; it does not support tool calling: {_WHAT_TO_DO}.",
            param=where,
        )
    try:
        return processor.chat_prompt(messages, **template_kwargs)
    except InvalidRequestError as e:
        cause = e.__cause__  # `apply_chat_template` raises from the template's own error
        if cause is None or not (calls_at or results_at):
            raise  # not a rendering failure, or nothing tool-related to render
        turns = [f"messages[{i}].tool_calls" for i in calls_at[:1]]
        turns += [f'messages[{i}] (role "tool")' for i in results_at[:1]]
        raise InvalidRequestError(
            f"the chat template failed on a conversation with tool turns ({', '.join(turns)}); "
            f"it said: {cause}. Either it does not support tool calling ({_WHAT_TO_DO}), or the "
            "turns are not shaped as it wants them (Mistral's templates want call ids of 9 "
            "letters or digits, which a server started with --tool-call-parser mistral gives).",
            param="messages",
        ) from cause


def _template_source(processor: InputProcessor, template_kwargs: dict[str, Any]) -> str | None:
    """The Jinja source that will render the messages (a named template such as "tool_use"
    resolved as Transformers resolves it); None when there is none (`chat_prompt` says so)."""
    tokenizer = processor.tokenizer
    if tokenizer is None:
        return None
    try:
        source = tokenizer.get_chat_template(
            template_kwargs.get("chat_template"), tools=template_kwargs.get("tools")
        )
    except ValueError:
        return None
    return source if isinstance(source, str) else None


def _reads_tool_calls(source: str) -> bool:
    """Whether a template reads `tool_calls` anywhere outside its comments."""
    return "tool_calls" in _COMMENT.sub("", source)
