"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's names): the `<think>...</think>` block of a
reply goes to `reasoning_content`, the text after it (less its leading whitespace) to `content`.

`split(text, final)` works like a tool parser's `scan` (see `tool_parsers/base.py`): while the
text may still grow it holds back a tag that is still being written, so what it returns only
ever grows and streaming sends each part as it comes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from inferengine.entrypoints.openai.tool_parsers.base import partial_tag_len, skip_space

START, END = "<think>", "</think>"


class ReasoningParser:
    name: ClassVar[str] = ""
    # A reply that does not open with <think> is: all content (False) or reasoning up to
    # </think> (True: the chat template opened the block in the prompt).
    opened_by_template: ClassVar[bool] = False
    thinking_switch: ClassVar[str] = ""  # how a request turns thinking off, if it can

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far."""
        lead = skip_space(text, 0)
        if text.startswith(START, lead):
            inner = lead + len(START)
        elif not final and START.startswith(text[lead:]):
            return "", ""  # <think> may still be being written
        elif self.opened_by_template:
            inner = 0
        else:
            return "", text
        end = text.find(END, inner)
        if end < 0:
            reasoning = text[inner:]
            if not final:
                reasoning = reasoning[: len(reasoning) - partial_tag_len(reasoning, (END,))]
            return reasoning, ""
        return text[inner:end], text[end + len(END) :].lstrip()

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply: (reasoning, content), each None when empty."""
        reasoning, content = self.split(text, final=True)
        return reasoning or None, content or None

    def thinking_off(self, template_kwargs: dict[str, Any]) -> bool:
        """Whether the request turned thinking off (so the reply has no reasoning block)."""
        return False


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only when the reply opens with `<think>` (a reply cut off inside it is all
    reasoning); `chat_template_kwargs` {"enable_thinking": false} turns thinking off. For
    templates that open `<think>` in the prompt (Qwen3 2507 Thinking) use `deepseek_r1`."""

    name = "qwen3"
    thinking_switch = 'chat_template_kwargs {"enable_thinking": false}'

    def thinking_off(self, template_kwargs: dict[str, Any]) -> bool:
        return template_kwargs.get("enable_thinking") is False


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek R1 (and its distills): its template opens `<think>` in the prompt, so the reply is
    reasoning until `</think>` (all of it if the reply ends first); a leading `<think>` is dropped."""

    name = "deepseek_r1"
    opened_by_template = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}
