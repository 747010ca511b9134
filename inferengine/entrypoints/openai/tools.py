"""The tool fields of a chat request checked (`tools`, `tool_choice`, `parallel_tool_calls`), the
JSON schema that makes a "required" or named `tool_choice` certain, and the tool calls of earlier
assistant turns prepared for the chat template.

As in OpenAI's API and vLLM's: `tool_choice` defaults to "auto" when tools are given; "auto" asks
the server's tool-call parser to find calls in free text; "required" and a named function are
enforced by structured output, so the reply is always a call (unless it runs out of tokens).

`"strict": true` on a function: with "required" or a named function its parameters are enforced
anyway. With "auto", as in vLLM, a strict tool puts the reply under a grammar that leaves the
text free but, from the parser's call tag on (`<tool_call>`, `[TOOL_CALLS]`, `{"name": "`),
holds the call to the format the parser reads, to one of the tools' names, and to that tool's
parameters when it is strict (any object when not; vLLM also holds tools that leave `strict`
out to their parameters, OpenAI's API only strict ones). A strict tool with other structured
output (`response_format`, ...) merges the two, as OpenAI's API allows: the reply is either the
answer that output asks for (the content) or only calls, held as above.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from inferengine.errors import InvalidRequestError
from inferengine.sampling_params import StructuredOutputsParams
from inferengine.structured_output.grammar import check_grammar, grammar_list

_CHOICES = ("none", "auto", "required")
_NAMED_SHAPE = '{"type": "function", "function": {"name": "my_function"}}'
# Keys of a tool's parameters schema that only mean something at the root of a schema.
_ROOT_ONLY = ("$schema", "$id")


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tool fields."""

    tools: list[dict[str, Any]]  # as sent, for the chat template
    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def strict_indexes(self) -> list[int]:
        """The indexes of the tools sent with `"strict": true`."""
        return [i for i, t in enumerate(self.tools) if t["function"].get("strict") is True]

    def strict_outputs(
        self, parser: Any, tokenizer: Any, answer: StructuredOutputsParams | None = None
    ) -> StructuredOutputsParams | None:
        """tool_choice "auto" with strict tools: a grammar that leaves the reply free until the
        tool parser's call tag, then holds the call to a tool's name and, for a strict tool, to
        its parameters (any object for the others); None when no tool is strict (vLLM's rule).
        With `answer` (the request's own structured output, as `response_format`), the reply
        is either that answer or only such calls. A 400 when `parser` (ToolParser) has no such
        grammar, or a strict tool's parameters are a schema llguidance cannot read."""
        if self.choice != "auto" or not self.strict_indexes:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            fn = tool["function"]
            schema: dict[str, Any] = {"type": "object"}
            if fn.get("strict") is True and fn.get("parameters") is not None:
                schema = fn["parameters"]
                _checked(schema, f"tools[{i}].function.parameters")
            tools.append((fn["name"], schema))
        name, grammars = (None, []) if answer is None else grammar_list(answer)
        grammar = parser.strict_grammar(tools, tokenizer, answer=name)
        if grammar is None:
            field = f"tools[{self.strict_indexes[0]}].function.strict"
            raise InvalidRequestError(
                f"{field} is true, but the {parser.name} tool call parser cannot hold "
                'tool_choice "auto" calls to their parameters; set strict false, or send '
                'tool_choice "required" or a named function.',
                param=field,
            )
        if grammars:  # one llguidance grammar list: the calls' Lark grammar first
            grammar = json.dumps({"grammars": [{"lark_grammar": grammar}, *grammars]})
        try:
            params = StructuredOutputsParams(grammar=grammar)
            check_grammar(params, None)
        except InvalidRequestError as e:
            raise InvalidRequestError(e.message, param="tools") from None
        return params

    def parameters(self, name: str) -> tuple[int, dict[str, Any] | None]:
        for i, tool in enumerate(self.tools):
            if tool["function"]["name"] == name:
                return i, tool["function"].get("parameters")
        raise KeyError(name)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The JSON the reply must be for a forced choice, its grammar checked (a 400 naming the
        tool whose parameters llguidance cannot read); None for "none" and "auto".

        Named: the function's arguments object. Required: an array (of one item without
        parallel tool calls) of {"name": one of the tools, "parameters": that tool's arguments},
        as vLLM builds it (one anyOf branch per tool)."""
        if not self.forced:
            return None
        if self.name is not None:
            index, params = self.parameters(self.name)
            return _checked(params or {"type": "object"}, f"tools[{index}].function.parameters")
        branches, defs = [], {}
        for i, tool in enumerate(self.tools):
            where = f"tools[{i}].function.parameters"
            params = tool["function"].get("parameters") or {"type": "object"}
            _checked(params, where)
            params = {k: v for k, v in params.items() if k not in _ROOT_ONLY}
            for key, value in params.pop("$defs", {}).items():
                if defs.setdefault(key, value) != value:
                    raise InvalidRequestError(
                        f'two tools define "$defs" {key!r} differently; with tool_choice '
                        '"required" their parameters share one schema, so rename one.',
                        param=where,
                    )
            branches.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [tool["function"]["name"]]},
                        "parameters": params,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return _checked(schema, "tools")


def _checked(schema: Any, param: str) -> StructuredOutputsParams:
    try:
        params = StructuredOutputsParams(json=copy.deepcopy(schema))
        check_grammar(params, None)
    except InvalidRequestError as e:
        raise InvalidRequestError(e.message, param=param) from None
    return params


def check_tools(req: Any) -> ToolRequest | None:
    """The request's tool fields, checked (a 400 naming the field that is wrong); None when it
    sends no tools and no tool_choice that asks for one."""
    tools = req.tools
    choice = req.tool_choice
    if tools is not None:
        check_tool_list(tools)
    if choice is None:
        choice = "auto" if tools else "none"
    name = _check_choice(choice)
    if choice != "none" and tools is None:
        raise InvalidRequestError(
            "tool_choice needs tools: send the functions the model may call in tools.",
            param="tool_choice",
        )
    if name is not None:
        known = [t["function"]["name"] for t in tools or []]
        if name not in known:
            raise InvalidRequestError(
                f"tool_choice names the function {name!r}, which is not in tools"
                + (f" ({', '.join(known)})." if known else "."),
                param="tool_choice.function.name",
            )
        choice = "named"
    if not tools:
        return None  # an empty list offers nothing to call: like tool_choice "none" (vLLM's)
    parallel = req.parallel_tool_calls is not False
    return ToolRequest(tools=list(tools), choice=choice, name=name, parallel=parallel)


def check_tool_list(tools: list[Any]) -> None:
    """A 400 naming the first malformed tool field (also used by /tokenize)."""
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(
                f'{where} must be an object: {{"type": "function", "function": {{...}}}}.',
                param=where,
            )
        if tool.get("type", "function") != "function":
            raise InvalidRequestError(
                f"{where}.type {tool.get('type')!r} is not supported; only function tools are.",
                param=f"{where}.type",
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(
                f'{where}.function is required: an object with the function\'s "name" and '
                'optionally "description", "parameters" (a JSON schema) and "strict".',
                param=f"{where}.function",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(
                f"{where}.function.name is required: a non-empty string.",
                param=f"{where}.function.name",
            )
        if name in seen:
            raise InvalidRequestError(
                f"{where}.function.name {name!r} is already the name of tools[{seen[name]}]; "
                "function names must be unique.",
                param=f"{where}.function.name",
            )
        seen[name] = i
        for key, kind, what in (
            ("description", str, "a string"),
            ("parameters", dict, "a JSON schema object"),
            ("strict", bool, "a boolean"),
        ):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise InvalidRequestError(
                    f"{where}.function.{key} must be {what}.", param=f"{where}.function.{key}"
                )


def _check_choice(choice: str | dict[str, Any]) -> str | None:
    """The function a named tool_choice names; None for the string choices."""
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise InvalidRequestError(
                f"tool_choice {choice!r} is not supported; use 'none', 'auto', 'required' or "
                f"{_NAMED_SHAPE}.",
                param="tool_choice",
            )
        return None
    if choice.get("type") != "function":
        raise InvalidRequestError(
            f"tool_choice of type {choice.get('type')!r} is not supported; name a function: "
            f"{_NAMED_SHAPE}.",
            param="tool_choice.type",
        )
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            f"tool_choice.function.name is required: {_NAMED_SHAPE}.",
            param="tool_choice.function.name",
        )
    return name


def template_tool_calls(message: dict[str, Any], index: int) -> None:
    """An assistant message's `tool_calls` as chat templates read them (vLLM's rule): each
    call's `function.arguments` a dict, parsed from the JSON text OpenAI's API sends (null or
    empty: `{}`), after the function's `name`. A null or empty list is taken out: templates
    that ask `'tool_calls' in message` (Llama 3.1's) would render a turn without calls as one."""
    calls = message.get("tool_calls")
    if calls is None:
        message.pop("tool_calls", None)
        return
    where = f"messages[{index}].tool_calls"
    if message.get("role") != "assistant":
        raise InvalidRequestError(
            f"{where}: only assistant messages carry tool calls.", param=where
        )
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where} must be a list.", param=where)
    if not calls:
        del message["tool_calls"]
        return
    prepared = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(
                f'{where}[{j}] must be {{"id": ..., "type": "function", "function": {{"name": '
                '..., "arguments": "<JSON object>"}}.',
                param=f"{where}[{j}]",
            )
        args = fn.get("arguments")
        if isinstance(args, str) and args.strip():
            try:
                args = json.loads(args)
            except ValueError as e:
                raise InvalidRequestError(
                    f"{where}[{j}].function.arguments is not valid JSON: {e}.",
                    param=f"{where}[{j}].function.arguments",
                ) from None
        elif not args:
            args = {}
        if not isinstance(args, dict):
            raise InvalidRequestError(
                f"{where}[{j}].function.arguments must be a JSON object.",
                param=f"{where}[{j}].function.arguments",
            )
        # name first: templates that write the function whole (Mistral's `tojson`) then write
        # it as models write calls, whatever order the client's JSON had (the SDK's: arguments)
        prepared.append({**call, "function": {"name": fn["name"], **fn, "arguments": args}})
    message["tool_calls"] = prepared
