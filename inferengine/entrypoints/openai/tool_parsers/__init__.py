"""Tool-call parsers for `tool_choice` "auto" (`--enable-auto-tool-choice --tool-call-parser
NAME`), one module per model family, found by vLLM's names. `base.py` says what a parser does."""

from __future__ import annotations

from inferengine.entrypoints.openai.tool_parsers.base import (
    CallDelta,
    ParsedCall,
    ToolCallStream,
    ToolParser,
    make_call_id,
)
from inferengine.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from inferengine.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from inferengine.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = [
    "TOOL_PARSERS",
    "CallDelta",
    "ParsedCall",
    "ToolCallStream",
    "ToolParser",
    "make_call_id",
]
