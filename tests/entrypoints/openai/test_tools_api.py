"""Tool calling and reasoning on chat, without a model: request checks (a 400 naming the field),
the schema a forced tool_choice becomes, tools and tool turns through the chat template, and the
replies built from scripted engine outputs, whole and streamed (tool_choice "auto" included,
which a random model never exercises).

`ServingChat` runs on a stand-in engine: the test tokenizer (or one with `<think>` tokens) and a
real `InputProcessor`."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from inferengine.engine.input_processor import InputProcessor
from inferengine.entrypoints.openai.protocol import ChatCompletionRequest
from inferengine.entrypoints.openai.serving_chat import ServingChat, single_token_id
from inferengine.entrypoints.openai.streaming import EngineStream
from inferengine.errors import ConfigError, InvalidRequestError
from inferengine.outputs import CompletionOutput, RequestOutput
from inferengine.sampling_params import StructuredOutputsParams
from tests.conftest import EOS_ID, VOCAB_SIZE, build_tokenizer

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER_PARAMS,
    },
}
ADD = {"type": "function", "function": {"name": "add"}}  # no parameters
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
# Hermes-style: tools in a system turn, calls as <tool_call> blocks, tool results as turns.
TOOL_TEMPLATE = (
    "{%- if tools %}<s>system: You may call:\n"
    "{%- for t in tools %}\n{{ t.function | tojson }}{%- endfor %}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<s>assistant:"
    '{%- for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{%- endfor %}\n'
    "{%- elif m.role == 'tool' %}<s>tool {{ m.tool_call_id }}: {{ m.content }}\n"
    "{%- else %}<s>{{ m.role }}: {{ m.content }}\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<s>assistant:{% endif %}"
)


THINK_ID, END_THINK_ID = 2, 3  # in `build_thinking_tokenizer`


def build_thinking_tokenizer():
    """The test tokenizer's recipe (tests/conftest.py) with `<think>` and `</think>` as two more
    special tokens, ids 2 and 3, still VOCAB_SIZE tokens: a reasoning model's tokenizer."""
    fast = build_tokenizer(("<think>", "</think>"))
    assert len(fast) == VOCAB_SIZE
    assert fast.convert_tokens_to_ids(["<think>", "</think>"]) == [THINK_ID, END_THINK_ID]
    return fast


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def thinking_tokenizer():
    return build_thinking_tokenizer()


def serving(tokenizer, **options) -> ServingChat:
    model_config = SimpleNamespace(
        name="tiny",
        max_model_len=512,
        generation_config={},
        hf_config={"eos_token_id": EOS_ID},
        vocab_size=len(tokenizer),
    )
    engine = SimpleNamespace(
        model_config=model_config,
        tokenizer=tokenizer,
        input_processor=InputProcessor(model_config, tokenizer),  # type: ignore[arg-type]
    )
    return ServingChat(engine, log_requests=False, **options)  # type: ignore[arg-type]


AUTO = {"enable_auto_tools": True, "tool_parser": "hermes"}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def prepare(tokenizer, options=None, **fields):
    return serving(tokenizer, **(options or {})).prepare(chat(**fields))


def refused(tokenizer, options=None, **fields) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        prepare(tokenizer, options, **fields)
    return info.value


# ---- request checks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        (
            {"tools": [WEATHER, {"type": "function", "function": {}}]},
            "tools[1].function.name",
            "required",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": ""}}]},
            "tools[0].function.name",
            "required",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "required"),
        ({"tools": ["get_weather"]}, "tools[0]", "object"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
            "JSON schema object",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
            "tools[0].function.strict",
            "boolean",
        ),
        ({"tools": [WEATHER, ADD, WEATHER]}, "tools[2].function.name", "tools[0]"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "needs tools",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}},
            "tool_choice.function.name",
            "'add', which is not in tools (get_weather)",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function.name",
            "required",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}},
            "tool_choice.type",
            "not supported",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
            "foo",
        ),
        # structured output twice: the forced tool choice is itself structured output
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "both constrain",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "guided_regex": "a+",
            },
            "guided_regex",
            "both constrain",
        ),
        # the legacy fields
        ({"functions": [WEATHER["function"]]}, "functions", "use tools and tool_choice"),
        ({"function_call": {"name": "get_weather"}}, "function_call", "use tools and tool_choice"),
        # tool calls of earlier turns
        (
            {
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{bad"},
                            }
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
            "not valid JSON",
        ),
        (
            {
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "[1]"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
            "JSON object",
        ),
        (
            {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [{"id": "1"}]}]},
            "messages[1].tool_calls[0]",
            "must be",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages[0].tool_calls",
            "only assistant",
        ),
    ],
)
def test_bad_tool_fields_are_a_400_naming_them(tokenizer, fields, param, says):
    error = refused(tokenizer, AUTO, **fields)
    assert error.param == param, error.message
    assert says in error.message, error.message


def test_auto_needs_the_server_flags(tokenizer):
    for fields in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        error = refused(tokenizer, **fields)
        assert error.param == "tool_choice"
        assert "--enable-auto-tool-choice and --tool-call-parser" in error.message
    # --tool-call-parser alone serves no "auto" either (as in vLLM)
    error = refused(tokenizer, {"tool_parser": "hermes"}, tools=[WEATHER])
    assert error.param == "tool_choice"
    # with both, the parser reads the reply
    reader = prepare(tokenizer, AUTO, tools=[WEATHER])[2]
    assert reader.tool_parser is not None and reader.forced is None


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [WEATHER], "tool_choice": "none"},
        {"tools": [], "tool_choice": "auto"},
        {"tools": [], "tool_choice": "required"},  # vLLM: like "none"
        {"tool_choice": "none"},
        {"tools": None, "functions": None, "function_call": "none"},
    ],
)
def test_choices_that_ask_for_no_call(tokenizer, fields):
    _, params, reader, _ = prepare(tokenizer, **fields)
    assert reader.plain and params.structured_outputs is None


def test_server_options_are_checked(tokenizer):
    with pytest.raises(ConfigError, match="unknown tool call parser"):
        serving(tokenizer, tool_parser="nope")
    with pytest.raises(ConfigError, match="unknown reasoning parser"):
        serving(tokenizer, reasoning_parser="nope")


# ---- forced choices: the schema ------------------------------------------------------------


def test_named_choice_is_the_functions_parameters(tokenizer):
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, params, reader, _ = prepare(tokenizer, tools=[ADD, WEATHER], tool_choice=named)
    assert params.structured_outputs == StructuredOutputsParams(json=WEATHER_PARAMS)
    assert reader.forced.name == "get_weather"
    named = {"type": "function", "function": {"name": "add"}}
    _, params, _, _ = prepare(tokenizer, tools=[ADD, WEATHER], tool_choice=named)
    assert params.structured_outputs == StructuredOutputsParams(json={"type": "object"})


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_choice_is_an_array_of_calls(tokenizer, parallel):
    _, params, reader, _ = prepare(
        tokenizer, tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=parallel
    )
    schema = params.structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema.get("maxItems") == (1 if parallel is False else None)
    weather, add = schema["items"]["anyOf"]
    assert weather["properties"] == {
        "name": {"type": "string", "enum": ["get_weather"]},
        "parameters": WEATHER_PARAMS,
    }
    assert add["properties"]["parameters"] == {"type": "object"}
    assert weather["required"] == ["name", "parameters"]
    assert reader.forced.name is None


def test_required_choice_lifts_defs_to_the_root(tokenizer):
    def tool(name, defs):
        params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": defs}
        return {"type": "function", "function": {"name": name, "parameters": params}}

    p = {"P": {"type": "integer"}}
    _, params, _, _ = prepare(tokenizer, tools=[tool("a", p), tool("b", p)], tool_choice="required")
    schema = params.structured_outputs.json
    assert schema["$defs"] == p
    assert all("$defs" not in b["properties"]["parameters"] for b in schema["items"]["anyOf"])
    error = refused(
        tokenizer,
        tools=[tool("a", p), tool("b", {"P": {"type": "string"}})],
        tool_choice="required",
    )
    assert error.param == "tools[1].function.parameters" and "$defs" in error.message


# ---- reasoning parser and structured output ------------------------------------------------


STRUCTURED = [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    (
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        "tool_choice",
    ),
]
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.parametrize(("fields", "param"), STRUCTURED)
def test_reasoning_parser_needs_a_single_end_of_thinking_token(tokenizer, fields, param):
    # the test tokenizer spells </think> in several tokens: the engine could not see it
    options = {"reasoning_parser": "qwen3"}
    error = refused(tokenizer, options, **fields)
    assert error.param == param
    assert "--reasoning-parser qwen3" in error.message
    assert "tokenizer has no single </think> token" in error.message
    assert "grammar cannot start after the reasoning" in error.message
    assert 'chat_template_kwargs {"enable_thinking": false}' in error.message
    # with thinking off there is no <think> block, so the grammar can start at once
    _, params, reader, _ = prepare(tokenizer, options, **fields, **THINKING_OFF)
    constrained = params.structured_outputs
    assert constrained is not None and reader.reasoning is not None
    assert constrained.reasoning_end_token_id is None
    # deepseek_r1 always thinks, and has no switch to offer
    error = refused(tokenizer, {"reasoning_parser": "deepseek_r1"}, **fields, **THINKING_OFF)
    assert error.param == param and "no single </think> token" in error.message
    assert "enable_thinking" not in error.message


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize(("fields", "param"), STRUCTURED)
def test_reasoning_parser_starts_the_grammar_after_thinking(
    thinking_tokenizer, parser, fields, param
):
    options = {"reasoning_parser": parser}
    _, params, reader, _ = prepare(thinking_tokenizer, options, **fields)
    constrained = params.structured_outputs
    assert constrained.reasoning_start_token_id == THINK_ID
    assert constrained.reasoning_end_token_id == END_THINK_ID
    assert reader.reasoning.name == parser
    assert (reader.forced is not None) == (param == "tool_choice")
    # the grammar is the same as without a reasoning parser
    plain = prepare(thinking_tokenizer, **fields)[1].structured_outputs
    assert constrained.key == plain.key and plain.reasoning_end_token_id is None
    # thinking off (qwen3): constrained from the first token
    off = prepare(thinking_tokenizer, options, **fields, **THINKING_OFF)[1].structured_outputs
    if parser == "qwen3":
        assert off.reasoning_start_token_id is None and off.reasoning_end_token_id is None
    else:  # deepseek_r1 has no switch: enable_thinking is only a template variable
        assert off.reasoning_end_token_id == END_THINK_ID


def test_no_structured_output_sets_nothing(thinking_tokenizer):
    params = prepare(thinking_tokenizer, {"reasoning_parser": "qwen3"})[1]
    assert params.structured_outputs is None


def test_single_token_ids(tokenizer, thinking_tokenizer):
    assert single_token_id(thinking_tokenizer, "<think>") == THINK_ID
    assert single_token_id(thinking_tokenizer, "</think>") == END_THINK_ID
    assert single_token_id(tokenizer, "</think>") is None  # several tokens
    assert single_token_id(tokenizer, "<s>") == 0
    token = tokenizer.convert_ids_to_tokens(300)  # a merged token of the trained vocab
    assert single_token_id(tokenizer, token) == 300
    # only the closing tag as one token: the grammar still starts after it
    chat_serving = serving(tokenizer, reasoning_parser="deepseek_r1")
    chat_serving.reasoning_token_ids = (None, 7)
    params = chat_serving.prepare(chat(guided_regex="a+"))[1]
    assert params.structured_outputs.reasoning_start_token_id is None
    assert params.structured_outputs.reasoning_end_token_id == 7


@pytest.mark.parametrize("key", ["reasoning_end_token_id", "reasoning_start_token_id"])
def test_clients_cannot_set_the_reasoning_tokens(thinking_tokenizer, key):
    # only the server sets them; a client's would let it unconstrain the reply at will
    for options in ({}, {"reasoning_parser": "qwen3"}):
        error = refused(
            thinking_tokenizer, options, structured_outputs={"regex": "a+", key: END_THINK_ID}
        )
        assert error.param == f"structured_outputs.{key}"
        assert "not a structured output key" in error.message


def test_reasoning_parser_with_auto_tools(tokenizer):
    options = {"reasoning_parser": "qwen3", **AUTO}
    _, params, reader, _ = prepare(tokenizer, options, tools=[WEATHER])
    assert reader.reasoning.name == "qwen3" and reader.tool_parser.name == "hermes"
    assert params.structured_outputs is None


# ---- the prompt: tools and tool turns through the chat template ----------------------------

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
]


def _prompt_text(tokenizer, options=None, **fields) -> str:
    prompt = prepare(tokenizer, options, chat_template=TOOL_TEMPLATE, **fields)[0]
    return tokenizer.decode(prompt["prompt_token_ids"])


def test_tool_turns_reach_the_prompt(tokenizer):
    text = _prompt_text(tokenizer, AUTO, messages=HISTORY, tools=[WEATHER])
    assert "<s>tool call_1: sunny, 21 degrees<s>assistant:" in text  # the tool result
    # the earlier call, its arguments handed to the template as a dict
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in text
    assert '"name": "get_weather", "description": "The weather in a city."' in text  # the tool
    assert text.endswith("<s>assistant:")


def test_tool_choice_none_keeps_tools_in_the_prompt_unless_excluded(tokenizer):
    kept = _prompt_text(tokenizer, tools=[WEATHER], tool_choice="none")
    assert "You may call" in kept  # vLLM's default
    excluded = _prompt_text(
        tokenizer,
        {"exclude_tools_when_tool_choice_none": True},
        tools=[WEATHER],
        tool_choice="none",
    )
    assert "You may call" not in excluded
    assert "You may call" in _prompt_text(tokenizer, tools=[WEATHER], tool_choice="required")


# ---- replies from scripted engine outputs --------------------------------------------------


def _outputs(pieces: list[str], finish: str, n: int = 1, stop_token: bool = True):
    """Delta outputs, one per piece (each as one token), the last finished."""
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        yield RequestOutput(
            request_id="r",
            prompt=None,
            prompt_token_ids=[0],
            outputs=[
                CompletionOutput(
                    index=k,
                    text=piece,
                    token_ids=[EOS_ID if last and stop_token and finish == "stop" else 5],
                    finish_reason=finish if last else None,
                )
                for k in range(n)
            ],
            finished=last,
        )


def _final(pieces: list[str], finish: str, n: int = 1) -> RequestOutput:
    outputs = list(_outputs(pieces, finish, n))
    last = outputs[-1]
    for c in last.outputs:
        c.text = "".join(pieces)
        c.token_ids = [5] * (len(pieces) - 1) + c.token_ids
    return last


def run_full(chat_serving, req, pieces, finish, n=1):
    reader = chat_serving.prepare(req)[2]
    return chat_serving.response("chatcmpl-1", 3, reader, _final(pieces, finish, n))


def run_stream(chat_serving, req, pieces, finish) -> list[dict]:
    reader = chat_serving.prepare(req)[2]

    async def gen():
        for out in _outputs(pieces, finish, req.n):
            yield out

    async def collect():
        events = []
        async for event in chat_serving._stream("chatcmpl-1", req, 3, reader, EngineStream(gen())):
            events.append(event)
        return events

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def reassemble(chunks: list[dict], index: int = 0) -> dict:
    """The message a client builds from the chunks of one choice."""
    message = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in chunks:
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                slots = message["tool_calls"]
                if call["index"] not in slots:  # a call's first delta: id, type, name
                    assert call["index"] == len(slots), call
                    assert call.get("id") and call.get("type") == "function", call
                    assert "arguments" in call["function"], call
                    slots[call["index"]] = {"name": call["function"]["name"], "arguments": ""}
                else:  # then only the index and more arguments
                    assert set(call) == {"index", "function"}, call
                    assert set(call["function"]) == {"arguments"}, call
                slots[call["index"]]["arguments"] += call["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    calls = [message["tool_calls"][i] for i in sorted(message["tool_calls"])]
    return {
        "content": message["content"] or None,
        "reasoning_content": message["reasoning_content"] or None,
        "tool_calls": calls,
        "finish_reason": finish,
    }


def whole(response, index: int = 0) -> dict:
    choice = response.choices[index]
    message = choice.message
    return {
        "content": message.content,
        "reasoning_content": message.reasoning_content,
        "tool_calls": [
            {"name": t.function.name, "arguments": t.function.arguments}
            for t in message.tool_calls or []
        ],
        "finish_reason": choice.finish_reason,
    }


NAMED_WEATHER_CHOICE = {"type": "function", "function": {"name": "get_weather"}}
W_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
W_ARGS = '{"city": "Paris", "unit": "c"}'
REPLIES = [
    # (server options, request fields, pieces, finish, expected)
    (
        AUTO,
        {"tools": [WEATHER]},
        [
            "Let me ",
            "check.",
            "\n<tool",
            "_call>\n{",
            '"name": "get_weather", ',
            '"arguments": {"city": "Paris", "unit": "c"}}\n</tool_',
            "call>",
        ],
        "stop",
        {
            "content": "Let me check.",
            "reasoning_content": None,
            "tool_calls": [{"name": "get_weather", "arguments": W_ARGS}],
            "finish_reason": "tool_calls",
        },
    ),
    (
        AUTO,
        {"tools": [WEATHER]},
        ["It is ", "sunny."],
        "stop",
        {
            "content": "It is sunny.",
            "reasoning_content": None,
            "tool_calls": [],
            "finish_reason": "stop",
        },
    ),
    (
        AUTO,
        {"tools": [WEATHER, ADD], "parallel_tool_calls": False},
        [W_CALL, '<tool_call>{"name": "add", "arguments": {}}</tool_call>'],
        "stop",
        {
            "content": None,
            "reasoning_content": None,
            "tool_calls": [{"name": "get_weather", "arguments": W_ARGS}],
            "finish_reason": "tool_calls",
        },
    ),
    (
        {**AUTO, "reasoning_parser": "qwen3"},
        {"tools": [WEATHER]},
        ["<think>", "The user wants", " weather.", "</think>", "\n\n", W_CALL[:20], W_CALL[20:]],
        "stop",
        {
            "content": None,
            "reasoning_content": "The user wants weather.",
            "tool_calls": [{"name": "get_weather", "arguments": W_ARGS}],
            "finish_reason": "tool_calls",
        },
    ),
    (
        {"reasoning_parser": "deepseek_r1"},
        {},
        ["Paris is ", "in France.", "</th", "ink>", "\nSunny."],
        "stop",
        {
            "content": "Sunny.",
            "reasoning_content": "Paris is in France.",
            "tool_calls": [],
            "finish_reason": "stop",
        },
    ),
    (
        {},
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        ['{"city":', '"Paris",', '"unit":"c"}'],
        "stop",
        {
            "content": None,
            "reasoning_content": None,
            "tool_calls": [{"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'}],
            "finish_reason": "tool_calls",
        },
    ),
    (
        {},
        {"tools": [WEATHER], "tool_choice": "required"},
        [
            '[{"name":"get_weather",',
            '"parameters":{"city":"Paris","unit":"c"}},',
            '{"name":"add","parameters":{}}]',
        ],
        "stop",
        {
            "content": None,
            "reasoning_content": None,
            "tool_calls": [  # the arguments as written
                {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'},
                {"name": "add", "arguments": "{}"},
            ],
            "finish_reason": "tool_calls",
        },
    ),
    (
        {},
        {"tools": [WEATHER], "tool_choice": "required"},
        ['[{"name":"get_weather",', '"parameters":{"ci'],
        "length",
        {  # cut short in a call: the call as written so far
            "content": None,
            "reasoning_content": None,
            "tool_calls": [{"name": "get_weather", "arguments": '{"ci'}],
            "finish_reason": "length",
        },
    ),
    (
        {},
        {"tools": [WEATHER], "tool_choice": "required"},
        ['[{"name":"get_wea'],
        "length",
        {  # cut short before any call began: the text
            "content": '[{"name":"get_wea',
            "reasoning_content": None,
            "tool_calls": [],
            "finish_reason": "length",
        },
    ),
]


@pytest.mark.parametrize(("options", "fields", "pieces", "finish", "expected"), REPLIES)
def test_reply_whole_and_streamed(tokenizer, options, fields, pieces, finish, expected):
    chat_serving = serving(tokenizer, **options)
    response = run_full(chat_serving, chat(**fields), pieces, finish)
    assert whole(response) == expected
    body = json.loads(response.model_dump_json())["choices"][0]["message"]
    assert ("tool_calls" in body) == bool(expected["tool_calls"])
    assert ("reasoning_content" in body) == (expected["reasoning_content"] is not None)
    for call in response.choices[0].message.tool_calls or []:
        assert call.id.startswith("call_") and call.type == "function"
    chunks = run_stream(chat_serving, chat(stream=True, **fields), pieces, finish)
    assert reassemble(chunks) == expected


def test_content_streams_before_the_call(tokenizer):
    chunks = run_stream(
        serving(tokenizer, **AUTO), chat(stream=True, tools=[WEATHER]), REPLIES[0][2], "stop"
    )
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    contents = [d["content"] for d in deltas if d.get("content")]
    # as generated, not held back to the end (trailing whitespace waits for what follows it)
    assert contents == ["Let me", " check."]
    calls = [d for d in deltas if d.get("tool_calls")]
    assert len(calls) == 1 and calls[0]["tool_calls"][0]["function"]["name"] == "get_weather"


STREAMED_CALLS = [
    # (server options, request fields, pieces): the arguments open in the third piece
    (
        AUTO,
        {"tools": [WEATHER]},
        [
            "<tool_call>\n",
            '{"name": "get_weather", "arguments": ',
            '{"city": ',
            '"Par',
            'is", "unit"',
            ': "c"}}\n</tool_call>',
        ],
    ),
    (
        {},
        {"tools": [WEATHER], "tool_choice": NAMED_WEATHER_CHOICE},
        ["", "", '{"city": ', '"Par', 'is", "unit"', ': "c"}'],
    ),
    (
        {},
        {"tools": [WEATHER], "tool_choice": "required"},
        [
            "[",
            '{"name": "get_weather", "parameters": ',
            '{"city": ',
            '"Par',
            'is", "unit"',
            ': "c"}}]',
        ],
    ),
]


@pytest.mark.parametrize(("options", "fields", "pieces"), STREAMED_CALLS)
def test_arguments_stream_piecewise(tokenizer, options, fields, pieces):
    chat_serving = serving(tokenizer, **options)
    chunks = run_stream(chat_serving, chat(stream=True, **fields), pieces, "stop")
    deltas = [c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"]]
    calls = [d[0] for d in deltas if d]
    first, rest = calls[0], calls[1:]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert [c["function"]["arguments"] for c in rest] == ['"Par', 'is", "unit"', ': "c"}']
    assert all(set(c) == {"index", "function"} and c["index"] == 0 for c in rest)
    # the same call, whole
    response = run_full(chat_serving, chat(**fields), pieces, "stop")
    assert whole(response)["tool_calls"] == [{"name": "get_weather", "arguments": W_ARGS}]
    assert reassemble(chunks) == whole(response)


def test_n_choices_each_get_their_calls(tokenizer):
    named = {"type": "function", "function": {"name": "get_weather"}}
    req = chat(n=3, tools=[WEATHER], tool_choice=named)
    response = run_full(serving(tokenizer), req, ['{"city":"Oslo","unit":"f"}'], "stop", n=3)
    assert [c.finish_reason for c in response.choices] == ["tool_calls"] * 3
    ids = {c.message.tool_calls[0].id for c in response.choices}
    assert len(ids) == 3


@pytest.mark.parametrize(
    "calls",
    [
        ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]'],
        ["[TOOL_CALLS]get_weather[ARGS]", '{"city": "Paris", ', '"unit": "c"}'],
        ["[TOOL_CALLS]", "get_weather", "[CALL_ID]", "a1B2c3D4e", "[ARGS]", W_ARGS],
    ],
)
def test_mistral_parser_decodes_special_tokens_and_drops_the_stop_token(tokenizer, calls):
    options = {"enable_auto_tools": True, "tool_parser": "mistral"}
    chat_serving = serving(tokenizer, **options)
    _, params, reader, _ = chat_serving.prepare(chat(tools=[WEATHER]))
    assert params.skip_special_tokens is False and reader.strip_stop_token
    eos = tokenizer.decode([EOS_ID])
    pieces = ["Sure.", *calls, eos]
    response = run_full(chat_serving, chat(tools=[WEATHER]), pieces, "stop")
    expected = {
        "content": "Sure.",
        "reasoning_content": None,
        "tool_calls": [{"name": "get_weather", "arguments": W_ARGS}],
        "finish_reason": "tool_calls",
    }
    assert whole(response) == expected
    assert len(response.choices[0].message.tool_calls[0].id) == 9  # Mistral's ids
    chunks = run_stream(chat_serving, chat(stream=True, tools=[WEATHER]), pieces, "stop")
    assert reassemble(chunks) == expected
    # plain text: the stop token's text is dropped too
    response = run_full(chat_serving, chat(tools=[WEATHER]), ["Hello.", eos], "stop")
    assert response.choices[0].message.content == "Hello."


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
# With a reasoning parser the grammar constrains only what follows </think>: a forced call is
# read from that content, never from the reasoning (even reasoning that looks like a call).
REASONED_REPLIES = [
    (
        "qwen3",
        {"tools": [WEATHER], "tool_choice": NAMED_WEATHER},
        ["<think>", "It is", " Paris.", "</think>", '{"city":', '"Paris","unit":"c"}'],
        "stop",
        {
            "content": None,
            "reasoning_content": "It is Paris.",
            "tool_calls": [{"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'}],
            "finish_reason": "tool_calls",
        },
    ),
    (
        "deepseek_r1",
        {"tools": [WEATHER], "tool_choice": NAMED_WEATHER},
        ['{"city":"Oslo",', '"unit":"f"}', "</think>", '{"city":"Paris","unit":"c"}'],
        "stop",
        {
            "content": None,
            "reasoning_content": '{"city":"Oslo","unit":"f"}',
            "tool_calls": [{"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'}],
            "finish_reason": "tool_calls",
        },
    ),
    (
        "deepseek_r1",
        {"tools": [WEATHER, ADD], "tool_choice": "required"},
        ["Weather", " first.", "</think>", '[{"name":"add","parameters":{}}]'],
        "stop",
        {
            "content": None,
            "reasoning_content": "Weather first.",
            "tool_calls": [{"name": "add", "arguments": "{}"}],
            "finish_reason": "tool_calls",
        },
    ),
    (
        "deepseek_r1",
        {"response_format": {"type": "json_object"}},
        ["Some", " JSON.", "</think>", '{"a":', "1}"],
        "stop",
        {
            "content": '{"a":1}',
            "reasoning_content": "Some JSON.",
            "tool_calls": [],
            "finish_reason": "stop",
        },
    ),
    (  # cut short while thinking: all reasoning, no call
        "qwen3",
        {"tools": [WEATHER], "tool_choice": NAMED_WEATHER},
        ["<think>", "Hmm", ", the"],
        "length",
        {
            "content": None,
            "reasoning_content": "Hmm, the",
            "tool_calls": [],
            "finish_reason": "length",
        },
    ),
]


@pytest.mark.parametrize(("parser", "fields", "pieces", "finish", "expected"), REASONED_REPLIES)
def test_structured_reply_after_reasoning(
    thinking_tokenizer, parser, fields, pieces, finish, expected
):
    chat_serving = serving(thinking_tokenizer, reasoning_parser=parser)
    response = run_full(chat_serving, chat(**fields), pieces, finish)
    assert whole(response) == expected
    chunks = run_stream(chat_serving, chat(stream=True, **fields), pieces, finish)
    assert reassemble(chunks) == expected
