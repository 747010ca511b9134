"""Tool-call and reasoning parsers on model text: whole replies, and streams cut at every place,
which must add up to the whole reply (content streams before a call, never a tag piece)."""

from __future__ import annotations

import json
import random

import pytest

from inferengine.entrypoints.openai.chat_reply import ForcedCalls, ReplyReader
from inferengine.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from inferengine.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedCall
from inferengine.entrypoints.openai.tool_parsers.json_scan import JsonScanner, Read


def call(name: str, **args) -> ParsedCall:
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


WEATHER = call("get_weather", city="Paris", unit="c")
ADD = call("add", a=1, b=2)
W_JSON = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
A_JSON = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
W_LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
A_LLAMA = '{"name": "add", "parameters": {"a": 1, "b": 2}}'

W_ARGS = '{"city": "Paris", "unit": "c"}'

# parser -> [(text, content, calls)]; a call's arguments are the text the model wrote.
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
        # started (name read, arguments opened), then broke off: a call with what was written
        ('<tool_call>{"name": "f", "arguments": {</tool_call>', None, [ParsedCall("f", "{")]),
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
            None,
            [ParsedCall("get_weather", '{"city": "Par')],
        ),
        (
            '<tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_call>after',
            "after",
            [call("f", a=1)],
        ),
        ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
        (
            f'<tool_call>{W_JSON}</tool_call>\n<tool_call>{{"oops"}}</tool_call>',
            '\n<tool_call>{"oops"}</tool_call>',
            [WEATHER],
        ),
        (
            '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
            '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
            [],
        ),
        ('<tool_call>{"name": "f"}</tool_call>', None, [call("f")]),  # no arguments: {}
        ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [call("f", a=1)]),
        (
            '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
            None,
            [call("f", a=1)],
        ),
        (
            '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>',
            '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>',
            [],
        ),
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
        ('{"name": "f", "parameters": {', None, [ParsedCall("f", "{")]),  # cut short
        ('{"name": "f", "param', '{"name": "f", "param', []),
        ('{"answer": 42}', '{"answer": 42}', []),
        (f"  {W_LLAMA}\n", None, [WEATHER]),
        (f"{W_LLAMA} and more", "and more", [WEATHER]),
        ('{"name": "f", "parameters": {"a": 1] and', "] and", [ParsedCall("f", '{"a": 1')]),
        ("Text with {braces} inside.", "Text with {braces} inside.", []),
    ],
    "mistral": [
        ("The weather is fine.", "The weather is fine.", []),
        (f"[TOOL_CALLS][{W_JSON}]", None, [WEATHER]),
        (f"[TOOL_CALLS] [{W_JSON}, {A_JSON}]", None, [WEATHER, ADD]),
        (f"Let me look.[TOOL_CALLS][{W_JSON}]", "Let me look.", [WEATHER]),
        ('[TOOL_CALLS][{"name": "f", "arguments": {]', "]", [ParsedCall("f", "{")]),
        ('[TOOL_CALLS][{"nom": "f"}]', '[TOOL_CALLS][{"nom": "f"}]', []),
        ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
        ('[TOOL_CALLS]get_weather{"city": "Paris", "unit": "c"}', None, [WEATHER]),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
            None,
            [WEATHER, ADD],
        ),
        # as v11+ templates render earlier calls: the model's id is read past, not kept
        (f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{W_ARGS}", None, [WEATHER]),
        (
            f"Sure.[TOOL_CALLS]get_weather[CALL_ID]abcdefghi[ARGS]{W_ARGS}"
            '[TOOL_CALLS]add[CALL_ID]123456789[ARGS]{"a": 1, "b": 2}',
            "Sure.",
            [WEATHER, ADD],
        ),
        ("[TOOL_CALLS]f[CALL_ID]abc{}", "[TOOL_CALLS]f[CALL_ID]abc{}", []),
        ("[TOOL_CALLS]f[ARGS]oops", "[TOOL_CALLS]f[ARGS]oops", []),
        ('[TOOL_CALLS]f[ARGS]{"a": tru', None, [ParsedCall("f", '{"a": ')]),  # cut short
        ("[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
        ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
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


def assemble(deltas) -> list[ParsedCall]:
    """The calls that `CallDelta`s add up to: each call's first delta names it, later ones only
    carry more arguments, and calls begin in index order."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for d in deltas:
        if d.index not in names:
            assert d.name and d.index == len(names), d
            names[d.index], arguments[d.index] = d.name, ""
        else:
            assert d.name is None and d.arguments, d
        arguments[d.index] += d.arguments
    return [ParsedCall(names[i], arguments[i]) for i in sorted(names)]


def _stream_tools(parser, pieces):
    stream = parser.stream()
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        new_content, new_deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += new_content
        deltas += new_deltas
    return content or None, assemble(deltas)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL_CASES)
def test_stream_adds_up_to_the_whole(parser, text, content, calls):
    p = TOOL_PARSERS[parser]()
    for pieces in _chunkings(text):
        assert _stream_tools(p, pieces) == (content, calls), pieces


@pytest.mark.parametrize(
    ("parser", "call_text"),
    [
        ("hermes", f"<tool_call>{W_JSON}</tool_call>"),
        ("llama3_json", f"<|python_tag|>{W_LLAMA}"),
        ("mistral", f"[TOOL_CALLS][{W_JSON}]"),
        ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{W_ARGS}"),
        ("mistral", f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{W_ARGS}"),
    ],
)
def test_arguments_stream_as_they_are_written(parser, call_text):
    stream = TOOL_PARSERS[parser]().stream()
    before = "Let me look. "
    # The content comes out while the tag is still being written; no piece of the tag does.
    assert stream.feed(before + call_text[:3], final=False) == (before.rstrip(), [])
    head = call_text.index("{", call_text.find('"name"') + 1)  # the arguments' opening brace
    assert stream.feed(call_text[3:head], final=False) == ("", [])
    content, deltas = stream.feed(call_text[head], final=False)  # the arguments open
    assert content == ""
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", "{")]
    # then every written character of the arguments, at once (a number or literal whole)
    pieces = []
    for c in call_text[head + 1 :] + " ":
        content, deltas = stream.feed(c, final=False)
        assert content == ""
        pieces += [(d.index, d.name, d.arguments) for d in deltas]
    assert "".join(a for _, _, a in pieces) == W_ARGS[1:]
    assert all(index == 0 and name is None and len(a) == 1 for index, name, a in pieces)


def test_max_calls_keeps_the_first():
    stream = TOOL_PARSERS["hermes"]().stream(max_calls=1)
    text = f"<tool_call>{W_JSON}</tool_call><tool_call>{A_JSON}</tool_call>"
    content, deltas = stream.feed(text, final=True)
    assert (content, assemble(deltas)) == ("", [WEATHER])


def test_call_ids():
    hermes, mistral = TOOL_PARSERS["hermes"](), TOOL_PARSERS["mistral"]()
    assert hermes.make_call_id().startswith("call_") and len(hermes.make_call_id()) == 29
    assert len(mistral.make_call_id()) == 9 and mistral.make_call_id().isalnum()
    assert mistral.keeps_special_tokens and not hermes.keeps_special_tokens


# ---- the JSON scanner ----------------------------------------------------------------------

JSON_TEXTS = [
    '{"a": [1, -2.5e+3, true, false, null, "x\\"\\u00e9\\n"], "b": {}}',
    "[]",
    '{"k": "v"}',
    '{"emoji": "\\ud83d\\ude00 🙂", "n": 0}',
    '{"a": 01}',
    '{"a": 1.}',
    '{"a": -}',
    '{"a": tru}',
    '{"a": "\\x"}',
    '{"a": "\\u12g4"}',
    '{"a": "raw\nnewline"}',
    '{"a" 1}',
    '{"a": 1,}',
    "[1 2]",
    '{"a": [}',
    '{"a": 1}}',
]


@pytest.mark.parametrize("text", JSON_TEXTS)
def test_scanner_reads_json_as_json_loads_does(text):
    try:
        end = json.JSONDecoder().raw_decode(text)[1]
    except ValueError:
        end = None
    for pieces in _chunkings(text):
        scanner, seen = JsonScanner(0), ""
        for i, piece in enumerate(pieces):
            seen += piece
            status = scanner.advance(seen, final=i == len(pieces) - 1)
            while status is Read.MORE and scanner.pos < len(seen):
                status = scanner.advance(seen, final=i == len(pieces) - 1)
            # what it calls safe is always the beginning of some JSON value
            assert scanner.safe <= len(seen)
            if status is not Read.MORE:
                break
        if end is None:
            assert status is not Read.DONE, pieces
        else:
            assert (status, scanner.end) == (Read.DONE, end), pieces


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
    (  # cut short in the call: the call as written, and the reason it ended
        "qwen3+hermes",
        '<think>Hm.</think><tool_call>{"name": "get_weather", "arguments": {"ci',
        "length",
        (None, "Hm.", [ParsedCall("get_weather", '{"ci')]),
        "length",
    ),
    (
        "named",
        '{"city":"Paris","unit":"c"}',
        "stop",
        (None, None, [ParsedCall("get_weather", '{"city":"Paris","unit":"c"}')]),
        "tool_calls",
    ),
    (
        "named",
        '{"city":"Par',
        "length",
        (None, None, [ParsedCall("get_weather", '{"city":"Par')]),
        "length",
    ),
    ("named", " ", "length", (" ", None, []), "length"),
    (
        "required",
        '[{"name":"get_weather","parameters":{"city":"Paris","unit":"c"}},{"name":"add","parameters":{"a":1,"b":2}}]',
        "stop",
        (
            None,
            None,
            [
                ParsedCall("get_weather", '{"city":"Paris","unit":"c"}'),
                ParsedCall("add", '{"a":1,"b":2}'),
            ],
        ),
        "tool_calls",
    ),
    ("required", '[{"name":"add","param', "length", ('[{"name":"add","param', None, []), "length"),
    (
        "required",
        '[{"name":"add","parameters":{"a":1',
        "length",
        (None, None, [ParsedCall("add", '{"a":')]),
        "length",
    ),
    ("required", "[]", "stop", ("[]", None, []), "stop"),
]


def _calls_of(tool_calls):
    return [ParsedCall(t.function.name, t.function.arguments) for t in tool_calls or []]


def assemble_openai(tool_calls) -> list[ParsedCall]:
    """The calls that OpenAI-shaped tool call deltas add up to: the first of each index carries
    its id, type and name; later ones only the index and more arguments."""
    calls: dict[int, list[str]] = {}
    for d in tool_calls:
        if d.index not in calls:
            assert d.index == len(calls) and d.id and d.type == "function", d
            assert d.function.name and d.function.arguments is not None, d
            calls[d.index] = [d.function.name, d.function.arguments]
        else:
            assert d.id is None and d.type is None and d.function.name is None, d
            assert d.function.arguments, d
            calls[d.index][1] += d.function.arguments
    return [ParsedCall(*calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize(("reader", "text", "finish", "expected", "reason"), REPLIES)
def test_reply_whole_and_streamed(reader, text, finish, expected, reason):
    r = READERS[reader]
    message, got_reason = r.message(text, finish)
    assert (message.content, message.reasoning_content, _calls_of(message.tool_calls)) == expected
    assert got_reason == reason
    for pieces in _chunkings(text):
        stream = r.stream()
        content, reasoning, deltas, last = "", "", [], None
        for i, piece in enumerate(pieces):
            delta, last = stream.feed(piece, finish if i == len(pieces) - 1 else None)
            content += delta.content or ""
            reasoning += delta.reasoning_content or ""
            deltas += delta.tool_calls or []
        streamed = assemble_openai(deltas)
        assert (content or None, reasoning or None, streamed) == expected, pieces
        assert last == reason
