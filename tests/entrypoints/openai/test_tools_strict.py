"""`"strict": true` tools with tool_choice "auto": the grammar that leaves the reply free but
holds each call, from the tool parser's call tag on, to a tool's name and a strict tool's
parameters (checked with llguidance on the test tokenizer, with and without special-token tags),
and the requests that cannot have it (a 400 naming the field)."""

from __future__ import annotations

import pytest

from inferengine.entrypoints.openai.tool_parsers import ToolParser
from inferengine.entrypoints.openai.tools import check_tools
from inferengine.errors import InvalidRequestError
from tests.conftest import EOS_ID, build_tokenizer
from tests.entrypoints.openai.test_tools_api import (
    AUTO,
    END_THINK_ID,
    WEATHER,
    build_thinking_tokenizer,
    chat,
    prepare,
    refused,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def thinking_tokenizer():
    return build_thinking_tokenizer()


STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
LOOSE_ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object"}, "strict": False},
}
# parser -> (extra special tokens, free text, a good call, calls the grammar refuses)
STRICT_FORMATS = {
    "hermes": (
        (),
        "I will check. <tool_c is not a tag",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        '</tool_call>\n<tool_call>{"name": "add", "arguments": {"x": [1]}}</tool_call>',
        [
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": 5, "unit": "c"}}',
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", "unit": "k"}}',
            '<tool_call>\n{"name": "other", "arguments": {}}',
            "<tool_call>oops",
        ],
    ),
    "hermes-special": (  # <tool_call> and </tool_call> special tokens: referenced by id
        ("<tool_call>", "</tool_call>"),
        "I will check.",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
        '</tool_call><tool_call>{"name": "add", "arguments": {}}</tool_call>',
        ['<tool_call>{"name": "get_weather", "arguments": {"city": 5, "unit": "c"}}'],
    ),
    "llama3_json": (
        (),
        "Sunny, said {the} forecast.",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
        '{"name": "add", "parameters": {}}',
        ['{"name": "get_weather", "parameters": {"city": 5, "unit": "c"}}', '{"name": "x'],
    ),
    "mistral": (
        ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
        "Sure, [TOOL_ is text.",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]add[CALL_ID]'
        'a1B2c3D4e[ARGS]{"x": null}',
        ['[TOOL_CALLS]get_weather[ARGS]{"city": 5, "unit": "c"}', "[TOOL_CALLS]other[ARGS]{}"],
    ),
    "mistral-v3": (  # [TOOL_CALLS] and no [ARGS] token: the JSON list
        ("[TOOL_CALLS]",),
        "Sure.",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
        '{"name": "add", "arguments": {}}]',
        ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"unit": "c"}}]'],
    ),
}


def _accepts(grammar: str, tokenizer, text: str) -> bool:
    """Whether llguidance lets the reply `text`, then the end of text, through `grammar`."""
    import llguidance

    from inferengine.structured_output.grammar import make_tokenizer

    matcher = llguidance.LLMatcher(make_tokenizer(tokenizer, len(tokenizer), [EOS_ID]), grammar)
    for token in [*tokenizer.encode(text, add_special_tokens=False), EOS_ID]:
        if not matcher.consume_token(token) or matcher.is_error():
            return False
    return True


@pytest.mark.parametrize("form", list(STRICT_FORMATS))
def test_strict_tools_in_auto_hold_calls_to_their_parameters(form):
    extra, free, good, bad = STRICT_FORMATS[form]
    tok = build_tokenizer(extra)
    options = {"enable_auto_tools": True, "tool_parser": form.split("-")[0]}
    _, params, reader, _ = prepare(tok, options, tools=[STRICT_WEATHER, LOOSE_ADD])
    grammar = params.structured_outputs.grammar
    assert reader.tool_parser is not None and reader.forced is None
    assert _accepts(grammar, tok, free)  # the reply stays free text
    assert _accepts(grammar, tok, good)  # calls as the parser reads them
    assert _accepts(grammar, tok, free + good)
    for text in bad:  # a strict tool's parameters, the tools' names, the format
        assert not _accepts(grammar, tok, text), text
    content, calls = reader.tool_parser.extract(good)
    assert [c.name for c in calls] == ["get_weather", "add"] and not content


def test_no_strict_tool_leaves_auto_free(tokenizer):
    loose = {"type": "function", "function": {**WEATHER["function"], "strict": False}}
    for tools in ([WEATHER], [loose, LOOSE_ADD]):
        assert prepare(tokenizer, AUTO, tools=tools)[1].structured_outputs is None
    # a forced choice enforces the parameters anyway
    _, params, _, _ = prepare(tokenizer, tools=[STRICT_WEATHER], tool_choice="required")
    assert params.structured_outputs.json is not None


def test_strict_grammar_is_never_read_as_gbnf(tokenizer):
    params = {
        "type": "object",
        "properties": {"rule": {"type": "string", "description": "a ::= b"}},
    }
    tool = {"type": "function", "function": {"name": "g", "parameters": params, "strict": True}}
    grammar = prepare(tokenizer, AUTO, tools=[tool])[1].structured_outputs.grammar
    assert "::=" not in grammar
    assert _accepts(
        grammar, tokenizer, '<tool_call>{"name": "g", "arguments": {"rule": "a ::= b"}}</tool_call>'
    )
    assert not _accepts(grammar, tokenizer, '<tool_call>{"name": "g", "arguments": {"rule": 1}}')


def test_strict_tool_with_a_parser_without_a_grammar_is_a_400(tokenizer):
    class NoGrammar(ToolParser):
        name = "no-grammar"

    tools = check_tools(chat(tools=[LOOSE_ADD, STRICT_WEATHER]))
    with pytest.raises(InvalidRequestError) as info:
        tools.strict_outputs(NoGrammar(), tokenizer)
    assert info.value.param == "tools[1].function.strict"


def test_strict_tool_refusals(tokenizer, thinking_tokenizer):
    error = refused(
        tokenizer, AUTO, tools=[STRICT_WEATHER], response_format={"type": "json_object"}
    )
    assert error.param == "response_format"
    assert "strict tool tools[0]" in error.message and "strict false" in error.message
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}, "strict": True}}
    error = refused(tokenizer, AUTO, tools=[bad])
    assert error.param == "tools[0].function.parameters"
    # a reasoning model whose tokenizer cannot tell the engine where the reasoning ends
    options = {**AUTO, "reasoning_parser": "qwen3"}
    error = refused(tokenizer, options, tools=[LOOSE_ADD, STRICT_WEATHER])
    assert error.param == "tools[1].function.strict" and "</think>" in error.message
    _, params, _, _ = prepare(thinking_tokenizer, options, tools=[STRICT_WEATHER])
    assert params.structured_outputs.grammar is not None
    assert params.structured_outputs.reasoning_end_token_id == END_THINK_ID
