"""The request's options in chat's terms: tools, tool_choice, thinking and output_config, each
checked as Anthropic checks it (unknown keys refused) with an error naming where."""

from __future__ import annotations

from typing import Any

from inferengine.entrypoints.openai.reasoning_parsers import ReasoningParser
from inferengine.errors import InvalidRequestError
from inferengine.sampling_params import StructuredOutputsParams
from inferengine.structured_output.grammar import check_grammar

_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control", "strict"}


def check_keys(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    """Anthropic's 400 for a key it does not know."""
    for key in obj:
        if key not in allowed:
            raise InvalidRequestError(f"{where}.{key}: Extra inputs are not permitted", param=where)


def chat_tools(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[Any, str]]]:
    """Function tools for the chat template, and the cache_control marks on them (with where
    each stands)."""
    out, tool_marks = [], []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if tool.get("type", "custom") != "custom":
            raise InvalidRequestError(
                f"{where}.type: tool type {tool.get('type')!r} is not supported; only custom "
                "tools (name, description, input_schema) are: this server runs no tools itself.",
                param=f"{where}.type",
            )
        check_keys(tool, _TOOL_KEYS, where)
        function: dict[str, Any] = {"name": tool.get("name")}
        for key, name in (("description", "description"), ("input_schema", "parameters")):
            if tool.get(key) is not None:
                function[name] = tool[key]
        if "input_schema" not in tool:
            raise InvalidRequestError(f"{where}.input_schema: Field required", param=where)
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        if tool.get("cache_control") is not None:
            tool_marks.append((tool["cache_control"], f"{where}.cache_control"))
        out.append({"type": "function", "function": function})
    return out, tool_marks


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Chat's `tool_choice` and `parallel_tool_calls` for Anthropic's `tool_choice`."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise InvalidRequestError(
            f"tool_choice.type: {kind!r} is not one of 'auto', 'any', 'tool', 'none'",
            param="tool_choice.type",
        )
    allowed = {"type"}
    if kind != "none":
        allowed.add("disable_parallel_tool_use")
    if kind == "tool":
        allowed.add("name")
    check_keys(choice, allowed, "tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise InvalidRequestError(
            "tool_choice.disable_parallel_tool_use: Input should be a valid boolean",
            param="tool_choice",
        )
    parallel = None if disable is None else not disable
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise InvalidRequestError("tool_choice.name: Field required", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def thinking_kwargs(
    thinking: dict[str, Any] | None, parser: ReasoningParser | None, max_tokens: int | None
) -> tuple[dict[str, Any], bool]:
    """Chat template variables for `thinking`, and whether its text is omitted from the reply."""
    if thinking is None:
        return {}, False
    kind = thinking.get("type")
    keys = {"enabled": {"type", "budget_tokens", "display"}, "adaptive": {"type", "display"}}
    if kind not in ("enabled", "adaptive", "disabled"):
        raise InvalidRequestError(
            f"thinking.type: {kind!r} is not one of 'enabled', 'adaptive', 'disabled'",
            param="thinking.type",
        )
    check_keys(thinking, keys.get(kind, {"type"}), "thinking")
    switch = parser is not None and parser.thinking_off({"enable_thinking": False})
    if kind == "disabled":
        if parser is not None and not switch:
            raise InvalidRequestError(
                f"thinking.type: this server's model always thinks (--reasoning-parser "
                f"{parser.name} has no switch to turn thinking off); leave thinking out.",
                param="thinking.type",
            )
        return ({"enable_thinking": False} if switch else {}), False
    if parser is None:
        raise InvalidRequestError(
            "thinking: this server splits no thinking off its replies; start it with "
            "--reasoning-parser (qwen3, deepseek_r1) for a model that thinks, or leave thinking "
            "out.",
            param="thinking",
        )
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise InvalidRequestError(
                "thinking.budget_tokens: a positive integer is required", param="thinking"
            )
        if max_tokens is not None and budget >= max_tokens:
            raise InvalidRequestError(
                "thinking.budget_tokens: must be less than max_tokens", param="thinking"
            )
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise InvalidRequestError(
            f"thinking.display: {display!r} is not one of 'summarized', 'omitted'",
            param="thinking.display",
        )
    return ({"enable_thinking": True} if switch else {}), display == "omitted"


def output_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """`structured_outputs` for `output_config`; its schema checked by llguidance here."""
    if config is None:
        return None
    check_keys(config, {"format", "effort"}, "output_config")
    if config.get("effort") is not None:
        raise InvalidRequestError(
            "output_config.effort: effort levels are not supported; leave effort out.",
            param="output_config.effort",
        )
    fmt = config.get("format")
    if fmt is None:
        return None
    where = "output_config.format"
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise InvalidRequestError(
            f'{where}: only {{"type": "json_schema", "schema": {{...}}}} is supported', param=where
        )
    check_keys(fmt, {"type", "schema"}, where)
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidRequestError(f"{where}.schema: a JSON schema object is required", param=where)
    try:
        check_grammar(StructuredOutputsParams(json=fmt["schema"]), None)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{where}.schema: {e.message}", param=f"{where}.schema") from None
    return {"json": fmt["schema"]}
