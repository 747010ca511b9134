"""Anthropic-style cache breakpoints: `cache_control` marks on chat messages to leased prompt prefixes.

A mark on message i (on the message or on any of its content parts) leases the prompt prefix that
ends with message i: its length in tokens is that of `messages[: i + 1]` rendered with the same
chat template call (without the generation prompt) and tokenized the same way, cut to the longest
prefix it shares with the full prompt. The server and `LLM.chat` both go through here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inferengine.engine.input_processor import InputProcessor
from inferengine.errors import InvalidRequestError
from inferengine.logger import init_logger
from inferengine.retention import parse_retention

logger = init_logger(__name__)

DEFAULT_TTL = "5m"  # Anthropic's default
_ACCEPTED = (
    'accepted: {"type": "ephemeral"}, optionally with "ttl": "5m" (the default), "1h" or '
    'another duration such as "600s"'
)


def take_cache_control(
    messages: Sequence[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[int, float]]:
    """The messages without their `cache_control` marks (copies; the input is left alone), and
    the lease in seconds of each marked message, by index (the longest, if marked twice)."""
    out: list[dict[str, Any]] = []
    leases: dict[int, float] = {}
    for i, message in enumerate(messages):
        message = dict(message)
        marks = [(f"messages[{i}].cache_control", message.pop("cache_control", None))]
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and "cache_control" in part:
                    part = dict(part)
                    marks.append(
                        (f"messages[{i}].content[{j}].cache_control", part.pop("cache_control"))
                    )
                parts.append(part)
            message["content"] = parts
        for where, mark in marks:
            if mark is not None:
                leases[i] = max(leases.get(i, 0.0), parse_cache_control(mark, where))
        out.append(message)
    return out, leases


def parse_cache_control(mark: Any, where: str = "cache_control") -> float:
    """The lease in seconds that one `cache_control` object asks for."""
    if not isinstance(mark, dict):
        raise InvalidRequestError(f"{where} must be an object; {_ACCEPTED}.", param=where)
    unknown = sorted(set(mark) - {"type", "ttl"})
    if unknown:
        raise InvalidRequestError(
            f"{where} has unknown field(s) {unknown}; {_ACCEPTED}.", param=where
        )
    if mark.get("type") != "ephemeral":
        raise InvalidRequestError(
            f"{where}.type {mark.get('type')!r} is not supported; {_ACCEPTED}.",
            param=f"{where}.type",
        )
    ttl = mark.get("ttl")
    if ttl is None:
        ttl = DEFAULT_TTL
    elif ttl == "in_memory":  # OpenAI's word for "no lease": a breakpoint always has one
        raise InvalidRequestError(
            f"{where}.ttl must be a duration; {_ACCEPTED}.", param=f"{where}.ttl"
        )
    seconds = parse_retention(ttl, f"{where}.ttl")
    assert seconds is not None
    return seconds


def cache_breakpoints(
    processor: InputProcessor,
    messages: Sequence[dict[str, Any]],
    leases: dict[int, float],
    prompt_token_ids: Sequence[int],
    template_kwargs: dict[str, Any],
) -> list[tuple[int, float]]:
    """`(number of leading prompt tokens, lease in seconds)` for each marked message, by token
    count; `messages` and `template_kwargs` are those the prompt was rendered from. Renders
    nothing when no message is marked."""
    by_length: dict[int, float] = {}
    for i, ttl_s in sorted(leases.items()):
        kwargs = dict(template_kwargs, add_generation_prompt=False)
        if i < len(messages) - 1:  # an earlier message is closed in the full prompt
            kwargs.pop("continue_final_message", None)
        try:
            prefix = processor.chat_prompt(list(messages[: i + 1]), **kwargs)["prompt_token_ids"]
        except InvalidRequestError as e:  # a template that wants the whole conversation
            logger.warning("cache breakpoint on message %d dropped: %s", i, e.message)
            continue
        num_tokens = _common_prefix_length(prefix, prompt_token_ids)
        if num_tokens:
            by_length[num_tokens] = max(by_length.get(num_tokens, 0.0), ttl_s)
    return sorted(by_length.items())


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n
