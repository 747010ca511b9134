"""`"strict": true` tools with tool_choice "auto": the grammar that leaves the reply free but
holds each call, from the tool parser's call tag on, to a tool's name and a strict tool's
parameters (checked with llguidance on the test tokenizer, with and without special-token tags);
merged with the request's own structured output (`response_format`, ...), the reply is either
that answer or only calls; and the requests that cannot have it (a 400 naming the field)."""

from __future__ import annotations

import json

import pytest

from inferengine.entrypoints.openai.tool_parsers import ToolParser
from inferengine.entrypoints.openai.tools import check_tools
from inferengine.errors import InvalidRequestError
from inferengine.structured_output.grammar import grammar_text
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
CALL_TAG_ID = 2  # `<tool_call>` in `build_tool_tokenizer`
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
    "hermes-added": (  # tokens of their own that are not special, as Qwen's: both spellings
        None,
        "I will check.",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
        "</tool_call>\n<tool_call>\n"
        '{"name": "add", "arguments": {}}\n</tool_call>',
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


def build_tool_tokenizer():
    """The test tokenizer with `<tool_call>` and `</tool_call>` as ids 2 and 3, tokens of their
    own that are not special (as Qwen's: a reply decoded without special tokens keeps them)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = build_tokenizer(("<tool_call>", "</tool_call>"))
    data = json.loads(fast.backend_tokenizer.to_str())
    for token in data["added_tokens"]:
        if token["content"] in ("<tool_call>", "</tool_call>"):
            token["special"] = False
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = fast.chat_template
    assert tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"]) == [CALL_TAG_ID, 3]
    assert tok.decode([CALL_TAG_ID], skip_special_tokens=True) == "<tool_call>"
    return tok


def _form_tokenizer(extra):
    return build_tool_tokenizer() if extra is None else build_tokenizer(extra)


def _accepts(grammar: str, tokenizer, text: str | list[int]) -> bool:
    """Whether llguidance lets the reply `text` (or token ids), then the end of text, through
    `grammar`."""
    import llguidance

    from inferengine.structured_output.grammar import make_tokenizer

    matcher = llguidance.LLMatcher(make_tokenizer(tokenizer, len(tokenizer), [EOS_ID]), grammar)
    ids = text if isinstance(text, list) else tokenizer.encode(text, add_special_tokens=False)
    for token in [*ids, EOS_ID]:
        if not matcher.consume_token(token) or matcher.is_error():
            return False
    return True


@pytest.mark.parametrize("form", list(STRICT_FORMATS))
def test_strict_tools_in_auto_hold_calls_to_their_parameters(form):
    extra, free, good, bad = STRICT_FORMATS[form]
    tok = _form_tokenizer(extra)
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
    # a forced choice is itself structured output: with response_format, a 400
    error = refused(
        tokenizer,
        tools=[STRICT_WEATHER],
        tool_choice="required",
        response_format={"type": "json_object"},
    )
    assert error.param == "response_format" and "both constrain" in error.message
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


ANSWER = {
    "type": "object",
    "properties": {"reply": {"type": "string"}},
    "required": ["reply"],
    "additionalProperties": False,
}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


@pytest.mark.parametrize("form", list(STRICT_FORMATS))
def test_strict_tools_merge_with_response_format(form):
    extra, free, good, bad = STRICT_FORMATS[form]
    tok = _form_tokenizer(extra)
    options = {"enable_auto_tools": True, "tool_parser": form.split("-")[0]}
    tools = [STRICT_WEATHER, LOOSE_ADD]
    _, params, reader, _ = prepare(tok, options, tools=tools, response_format=ANSWER_FORMAT)
    grammar = params.structured_outputs.grammar
    assert _accepts(grammar, tok, '{"reply":"sunny"}')  # the answer (compact JSON)
    assert _accepts(grammar, tok, good)  # or only calls
    assert _accepts(grammar, tok, good + "\n")
    for text in [
        free,  # free text is neither
        free + good,
        '{"reply":"sunny"}' + good,  # not both
        '{"reply": 5}',
        '{"other":"x"}',
        *bad,
    ]:
        assert not _accepts(grammar, tok, text), text
    content, calls = reader.tool_parser.extract('{"reply":"sunny"}')
    assert content == '{"reply":"sunny"}' and not calls


@pytest.mark.parametrize(
    ("fields", "answer", "not_answer"),
    [
        ({"response_format": {"type": "json_object"}}, '{"a":[1]}', "[1]"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "no", "maybe"),
        ({"structured_outputs": {"regex": "[0-9]{2}"}}, "42", "4"),
        ({"guided_grammar": 'start: "fine" | "bad"'}, "fine", "good"),
        ({"guided_grammar": 'root ::= "ok" [0-9]'}, "ok7", "ok"),  # GBNF
    ],
)
def test_every_structured_output_merges(tokenizer, fields, answer, not_answer):
    _, params, _, _ = prepare(tokenizer, AUTO, tools=[STRICT_WEATHER], **fields)
    grammar = params.structured_outputs.grammar
    assert grammar_text(params.structured_outputs) == grammar  # llguidance's list, as it is
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "P", "unit": "f"}}</tool_call>'
    assert _accepts(grammar, tokenizer, answer) and _accepts(grammar, tokenizer, call)
    assert not _accepts(grammar, tokenizer, not_answer)
    assert not _accepts(grammar, tokenizer, call.replace('"f"', '"k"'))


def test_merged_grammar_starts_after_reasoning(thinking_tokenizer):
    options = {**AUTO, "reasoning_parser": "qwen3"}
    _, params, _, _ = prepare(
        thinking_tokenizer, options, tools=[STRICT_WEATHER], response_format=ANSWER_FORMAT
    )
    assert params.structured_outputs.grammar.startswith('{"grammars"')
    assert params.structured_outputs.reasoning_end_token_id == END_THINK_ID


@pytest.mark.parametrize("answer", [None, ANSWER_FORMAT])
def test_a_tag_of_its_own_is_its_token_or_its_text(answer):
    # llguidance counts Qwen's `<tool_call>` (added, not special) as special: the grammar names
    # the token, or the model could not write it, and the text, which the parser reads too
    tok = build_tool_tokenizer()
    fields = {} if answer is None else {"response_format": answer}
    grammar = prepare(tok, AUTO, tools=[STRICT_WEATHER], **fields)[1].structured_outputs.grammar
    call = '{"name": "get_weather", "arguments": {"city": "P", "unit": "c"}}'
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert encode("<tool_call>") == [CALL_TAG_ID]
    for tag in ([CALL_TAG_ID], encode("<tool") + encode("_call>")):
        assert _accepts(grammar, tok, tag + encode(call + "</tool_call>"))
        bad = call.replace('"c"', '"k"')
        assert not _accepts(grammar, tok, tag + encode(bad + "</tool_call>"))


def test_llama3_json_calls_beside_an_answer_keep_their_definitions(tokenizer):
    # llama3_json calls are JSON as the answer is, so each call is one schema: its parameters'
    # "$defs" move to that schema's root, where their references point
    params = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"}},
        "required": ["p"],
        "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": params, "strict": True}}
    options = {"enable_auto_tools": True, "tool_parser": "llama3_json"}
    fields = {"tools": [tool], "response_format": ANSWER_FORMAT}
    grammar = prepare(tokenizer, options, **fields)[1].structured_outputs.grammar
    assert _accepts(grammar, tokenizer, '{"name": "f", "parameters": {"p": {"x": 1}}}')
    assert not _accepts(grammar, tokenizer, '{"name": "f", "parameters": {"p": {"x": "a"}}}')
    assert _accepts(grammar, tokenizer, '{"reply":"a"}')
