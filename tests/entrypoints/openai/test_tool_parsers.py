"""Tool-call and reasoning parsers on model text: whole replies, and streams cut at every place,
which must add up to the whole reply (content streams before a call, never a tag piece)."""

from __future__ import annotations

import json
import random

import pytest

from inferengine.entrypoints.openai.chat_reply import ForcedCalls, ReplyReader
from inferengine.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from inferengine.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedCall


def call(name: str, **args) -> ParsedCall:
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


WEATHER = call("get_weather", city="Paris", unit="c")
ADD = call("add", a=1, b=2)
W_JSON = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
A_JSON = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
W_LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
A_LLAMA = '{"name": "add", "parameters": {"a": 1, "b": 2}}'

# parser -> [(text, content, calls)]
CASES = {
    "hermes": [
        ("The weather is fine.", "The weather is fine.", []),
        (f"<tool_call>\n{W_JSON}\n</tool_call>", None, [WEATHER]),
        (
            f"<tool_call>\n{W_JSON}\n</tool_call>\n<tool_call>\n{A_JSON}\n</tool_call>",
            None,
            [WEATHER, ADD],
        ),
        (f"Let me look.\n\n<tool_call>{W_JSON}</tool_call>", "Let me look.", [WEATHER]),
        (f"<tool_call>{W_JSON}", None, [WEATHER]),  # no closing tag before the end
        (
            '<tool_call>{"name": "f", "arguments": {</tool_call>',
            '<tool_call>{"name": "f", "arguments": {</tool_call>',
            [],
        ),
        ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
        (
            f'<tool_call>{W_JSON}</tool_call>\n<tool_call>{{"oops"}}</tool_call>',
            '\n<tool_call>{"oops"}</tool_call>',
            [WEATHER],
        ),
        ('<tool_call>{"name": "f"}</tool_call>', None, [call("f")]),  # no arguments: {}
        ("Use <tool_c to call.", "Use <tool_c to call.", []),
        ("a < b", "a < b", []),
    ],
    "llama3_json": [
        ("The weather is fine.", "The weather is fine.", []),
        (W_LLAMA, None, [WEATHER]),
        (f"<|python_tag|>{W_LLAMA}", None, [WEATHER]),
        (f"{W_LLAMA}; {A_LLAMA}", None, [WEATHER, ADD]),
        (f"<|python_tag|>{W_LLAMA};{A_JSON}", None, [WEATHER, ADD]),
        (f"Let me look. <|python_tag|>{W_LLAMA}", "Let me look.", [WEATHER]),
        ('{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
        ('{"answer": 42}', '{"answer": 42}', []),
        (f"  {W_LLAMA}\n", None, [WEATHER]),
        (f"{W_LLAMA} and more", "and more", [WEATHER]),
        ("Text with {braces} inside.", "Text with {braces} inside.", []),
    ],
    "mistral": [
        ("The weather is fine.", "The weather is fine.", []),
        (f"[TOOL_CALLS][{W_JSON}]", None, [WEATHER]),
        (f"[TOOL_CALLS] [{W_JSON}, {A_JSON}]", None, [WEATHER, ADD]),
        (f"Let me look.[TOOL_CALLS][{W_JSON}]", "Let me look.", [WEATHER]),
        (
            '[TOOL_CALLS][{"name": "f", "arguments": {]',
            '[TOOL_CALLS][{"name": "f", "arguments": {]',
            [],
        ),
        ('[TOOL_CALLS][{"nom": "f"}]', '[TOOL_CALLS][{"nom": "f"}]', []),
        ('[TOOL_CALLS]get_weather{"city": "Paris", "unit": "c"}', None, [WEATHER]),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
            None,
            [WEATHER, ADD],
        ),
        ("[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
    ],
}
ALL_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL_CASES)
def test_extract(parser, text, content, calls):
    assert TOOL_PARSERS[parser]().extract(text) == (content, calls)


def _chunkings(text: str):
    yield list(text)  # a character at a time
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    rng = random.Random(len(text))
    for _ in range(20):
        pieces, pos = [], 0
        while pos < len(text):
            step = rng.randint(1, 6)
            pieces.append(text[pos : pos + step])
            pos += step
        yield pieces


def _stream_tools(parser, pieces):
    stream = parser.stream()
    content, calls = "", []
    for i, piece in enumerate(pieces):
        new_content, new_calls = stream.feed(piece, final=i == len(pieces) - 1)
        content += new_content
        calls += new_calls
    return content or None, calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL_CASES)
def test_stream_adds_up_to_the_whole(parser, text, content, calls):
    p = TOOL_PARSERS[parser]()
    for pieces in _chunkings(text):
        assert _stream_tools(p, pieces) == (content, calls), pieces


@pytest.mark.parametrize(
    ("parser", "before", "call_text"),
    [
        ("hermes", "Let me look. ", f"<tool_call>{W_JSON}</tool_call>"),
        ("llama3_json", "Let me look. ", f"<|python_tag|>{W_LLAMA}"),
        ("mistral", "Let me look. ", f"[TOOL_CALLS][{W_JSON}]"),
    ],
)
def test_content_streams_before_the_call_and_the_call_once_closed(parser, before, call_text):
    stream = TOOL_PARSERS[parser]().stream()
    # The content comes out while the tag is still being written; no piece of the tag does.
    content, calls = stream.feed(before + call_text[:3], final=False)
    assert (content, calls) == (before.rstrip(), [])
    content, calls = stream.feed(call_text[3:-1], final=False)
    assert (content, calls) == ("", [])
    content, calls = stream.feed(call_text[-1:] + " ", final=False)
    assert (content, calls) == ("", [WEATHER])  # complete before the reply ends


def test_max_calls_keeps_the_first():
    stream = TOOL_PARSERS["hermes"]().stream(max_calls=1)
    text = f"<tool_call>{W_JSON}</tool_call><tool_call>{A_JSON}</tool_call>"
    assert stream.feed(text, final=True) == ("", [WEATHER])


def test_call_ids():
    hermes, mistral = TOOL_PARSERS["hermes"](), TOOL_PARSERS["mistral"]()
    assert hermes.make_call_id().startswith("call_") and len(hermes.make_call_id()) == 29
    assert len(mistral.make_call_id()) == 9 and mistral.make_call_id().isalnum()
    assert mistral.keeps_special_tokens and not hermes.keeps_special_tokens


# ---- reasoning ------------------------------------------------------------------------------

REASONING_CASES = [
    ("qwen3", "<think>Let me see.</think>\n\nParis.", "Let me see.", "Paris."),
    ("qwen3", "\n<think>a</think>b", "a", "b"),
    ("qwen3", "Paris.", None, "Paris."),
    ("qwen3", "<think>cut off", "cut off", None),
    ("qwen3", "<think></think>Paris.", None, "Paris."),
    ("qwen3", "no think</think> here", None, "no think</think> here"),
    ("qwen3", "<thinking>", None, "<thinking>"),
    ("deepseek_r1", "Let me see.</think>Paris.", "Let me see.", "Paris."),
    ("deepseek_r1", "<think>Let me see.</think>Paris.", "Let me see.", "Paris."),
    ("deepseek_r1", "still thinking", "still thinking", None),
    ("deepseek_r1", "a</think>", "a", None),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning(parser, text, reasoning, content):
    p = REASONING_PARSERS[parser]()
    assert p.extract(text) == (reasoning, content)
    for pieces in _chunkings(text):
        got_r, got_c, seen = "", "", ""
        for i, piece in enumerate(pieces):
            seen += piece
            r, c = p.split(seen, final=i == len(pieces) - 1)
            assert r.startswith(got_r) and c.startswith(got_c), pieces
            got_r, got_c = r, c
        assert (got_r or None, got_c or None) == (reasoning, content), pieces


def test_thinking_switch():
    qwen3, r1 = REASONING_PARSERS["qwen3"](), REASONING_PARSERS["deepseek_r1"]()
    assert qwen3.thinking_off({"enable_thinking": False})
    assert not qwen3.thinking_off({}) and not qwen3.thinking_off({"enable_thinking": True})
    assert not r1.thinking_off({"enable_thinking": False})


# ---- a reply: reasoning, then calls ---------------------------------------------------------

READERS = {
    "plain": ReplyReader(),
    "qwen3+hermes": ReplyReader(
        reasoning=REASONING_PARSERS["qwen3"](), tool_parser=TOOL_PARSERS["hermes"]()
    ),
    "named": ReplyReader(forced=ForcedCalls("get_weather")),
    "required": ReplyReader(forced=ForcedCalls()),
}
REPLIES = [
    ("plain", "Paris.", "stop", ("Paris.", None, []), "stop"),
    (
        "qwen3+hermes",
        f"<think>Need weather.</think>\n\nChecking.<tool_call>\n{W_JSON}\n</tool_call>",
        "stop",
        ("Checking.", "Need weather.", [WEATHER]),
        "tool_calls",
    ),
    ("qwen3+hermes", "<think>Hm.</think>Paris.", "stop", ("Paris.", "Hm.", []), "stop"),
    ("qwen3+hermes", "<think>Hm, long", "length", (None, "Hm, long", []), "length"),
    (
        "named",
        '{"city":"Paris","unit":"c"}',
        "stop",
        (None, None, [call("get_weather", city="Paris", unit="c")]),
        "tool_calls",
    ),
    ("named", '{"city":"Par', "length", ('{"city":"Par', None, []), "length"),
    (
        "required",
        '[{"name":"get_weather","parameters":{"city":"Paris","unit":"c"}},{"name":"add","parameters":{"a":1,"b":2}}]',
        "stop",
        (None, None, [WEATHER, ADD]),
        "tool_calls",
    ),
    ("required", '[{"name":"add","param', "length", ('[{"name":"add","param', None, []), "length"),
    ("required", "[]", "stop", ("[]", None, []), "stop"),
]


def _calls_of(tool_calls):
    return [ParsedCall(t.function.name, t.function.arguments) for t in tool_calls or []]


@pytest.mark.parametrize(("reader", "text", "finish", "expected", "reason"), REPLIES)
def test_reply_whole_and_streamed(reader, text, finish, expected, reason):
    r = READERS[reader]
    message, got_reason = r.message(text, finish)
    forced_named = reader == "named"
    calls = _calls_of(message.tool_calls)
    if forced_named:  # the arguments are the constrained text itself
        calls = [ParsedCall(c.name, json.dumps(json.loads(c.arguments))) for c in calls]
    assert (message.content, message.reasoning_content, calls) == expected
    assert got_reason == reason
    for pieces in _chunkings(text):
        stream = r.stream()
        content, reasoning, deltas, last = "", "", [], None
        for i, piece in enumerate(pieces):
            delta, last = stream.feed(piece, finish if i == len(pieces) - 1 else None)
            content += delta.content or ""
            reasoning += delta.reasoning_content or ""
            deltas += delta.tool_calls or []
        assert [d.index for d in deltas] == list(range(len(deltas)))
        streamed = [ParsedCall(d.function.name, d.function.arguments) for d in deltas]
        if forced_named:
            streamed = [ParsedCall(c.name, json.dumps(json.loads(c.arguments))) for c in streamed]
        assert (content or None, reasoning or None, streamed) == expected, pieces
        assert last == reason
