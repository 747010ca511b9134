"""Chat message content: the text parts a text-only model can read, anything else refused.

The server and `LLM.chat` both check messages here, so an image part gets the same 400 from
either instead of reaching a chat template that would turn it into placeholder tokens.
"""

from __future__ import annotations

from typing import Any

from inferengine.errors import InvalidRequestError


def text_parts(content: Any) -> list[str] | None:
    """The texts of a message's content parts, in order; None when `content` is not a list of
    parts (a plain string, or absent). A part that is not text is an `InvalidRequestError`."""
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"message content parts of type {kind!r} are not supported (InferEngine serves "
                "text-only models); send text.",
                param="messages",
            )
        texts.append(part["text"])
    return texts
