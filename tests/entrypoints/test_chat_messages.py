"""Chat messages to chat templates (`entrypoints/chat_messages.py`), without a model: the shapes
OpenAI's SDK sends (null content beside tool calls, JSON-text arguments, text parts, `name`)
rendered by real tool-use templates (`chat_templates/`: Qwen2.5's, Qwen3's, Llama 3.1's and
Mistral 7B v0.3's, as their tokenizer_config.json ship them), and the 400 a template without tool
support gives."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest

from inferengine.engine.input_processor import InputProcessor
from inferengine.entrypoints.chat_messages import template_messages, templated_prompt
from inferengine.errors import InvalidRequestError
from tests.conftest import EOS_ID, build_tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
CALL_ID = "Ab3dE6gH9"  # Mistral's templates want 9 letters or digits
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# The conversation as OpenAI's SDK sends it once the reply's message is appended as it came back.
SDK_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": CALL_ID,
                "type": "function",
                # the SDK's field order, which Mistral's template would write as is
                "function": {"arguments": '{"city": "Paris"}', "name": "get_weather"},
            }
        ],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny, 21 degrees"},
]
# How each template writes the call and the tool's result.
RENDERED = {
    "qwen2_5": (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>',
        "<|im_start|>user\n<tool_response>\nsunny, 21 degrees\n</tool_response><|im_end|>",
    ),
    "qwen3": (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>',
        "<|im_start|>user\n<tool_response>\nsunny, 21 degrees\n</tool_response><|im_end|>",
    ),
    "llama3_1": (
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
        '"parameters": {"city": "Paris"}}<|eot_id|>',
        '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny, 21 degrees"<|eot_id|>',
    ),
    "mistral_v0_3": (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
        f'"id": "{CALL_ID}"}}]</s>',
        f'[TOOL_RESULTS] {{"content": sunny, 21 degrees, "call_id": "{CALL_ID}"}}[/TOOL_RESULTS]',
    ),
}


def load_template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def processor():
    tokenizer = build_tokenizer()
    config = SimpleNamespace(
        max_model_len=4096,
        generation_config={},
        hf_config={"eos_token_id": EOS_ID},
        vocab_size=len(tokenizer),
    )
    return InputProcessor(config, tokenizer)  # type: ignore[arg-type]


def render(processor, messages, template: str | None, **kwargs) -> str:
    prompt = templated_prompt(
        processor, template_messages(messages), chat_template=template, **kwargs
    )
    return prompt["prompt"]


def test_messages_as_templates_read_them():
    sent = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}], "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        *copy.deepcopy(SDK_HISTORY[1:]),
        {"role": "assistant", "content": None, "tool_calls": None},
        {"role": "assistant", "content": "ok", "tool_calls": []},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": ""}}]},
    ]
    before = copy.deepcopy(sent)
    out = template_messages(sent)
    assert sent == before  # copies: the caller's messages are left as given
    assert out[0] == {"role": "system", "content": "Be brief.", "name": "ops"}
    assert out[1]["content"] == "a\nb"
    assert out[2]["content"] == ""
    function = out[2]["tool_calls"][0]["function"]
    assert function == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert list(function) == ["name", "arguments"]  # as models write calls
    assert out[3] == SDK_HISTORY[2]
    assert out[4] == {"role": "assistant", "content": ""}  # no `tool_calls` key left
    assert out[5] == {"role": "assistant", "content": "ok"}
    assert out[6]["tool_calls"][0]["function"]["arguments"] == {}


def test_content_of_another_shape_is_a_400_naming_it():
    with pytest.raises(InvalidRequestError) as info:
        template_messages([{"role": "user", "content": 7}])
    assert info.value.param == "messages[0].content"


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_sdk_tool_turns_render_in_each_template(processor, name):
    text = render(processor, SDK_HISTORY, load_template(name), tools=[WEATHER])
    call, result = RENDERED[name]
    assert call in text and result in text, text
    assert "None" not in text
    assert '"name": "get_weather"' in text.split(call)[0]  # the tool itself, offered first


def test_qwen3_renders_the_sdk_message_that_broke_it(processor):
    # Qwen3's template asks `'</think>' in message.content`: a missing content was a Jinja
    # error ("'dict object' has no attribute 'content'"); null is "" as in vLLM.
    history = copy.deepcopy(SDK_HISTORY)
    history.append({"role": "assistant", "content": "It is sunny."})
    history.append({"role": "user", "content": [{"type": "text", "text": "And Rome?"}]})
    text = render(processor, history, load_template("qwen3"), tools=[WEATHER])
    assert text.endswith("<|im_start|>user\nAnd Rome?<|im_end|>\n<|im_start|>assistant\n")


def test_assistant_turn_with_null_content_and_no_calls(processor):
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": None},
        {"role": "user", "content": "Still there?"},
    ]
    text = render(processor, history, load_template("llama3_1"))
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n<|eot_id|>" in text
    assert "None" not in text


def test_template_that_never_reads_tool_calls_is_a_400(processor):
    # the test tokenizer's own template writes role and content only: the call would vanish
    with pytest.raises(InvalidRequestError) as info:
        render(processor, SDK_HISTORY, None, tools=[WEATHER])
    error = info.value
    assert error.param == "messages[1].tool_calls"
    assert "never reads tool_calls" in error.message
    assert "does not support tool calling" in error.message
    assert "chat_template" in error.message and "Jinja" not in error.message
    # without tool turns the same template serves, tools offered or not
    assert render(processor, SDK_HISTORY[:1], None, tools=[WEATHER]).endswith("<s>assistant:")


def test_template_that_fails_on_tool_turns_is_a_400_saying_so(processor):
    # Mistral's template wants 9-character call ids; OpenAI's are longer
    history = copy.deepcopy(SDK_HISTORY)
    history[1]["tool_calls"][0]["id"] = history[2]["tool_call_id"] = "call_" + "x" * 24
    with pytest.raises(InvalidRequestError) as info:
        render(processor, history, load_template("mistral_v0_3"), tools=[WEATHER])
    error = info.value
    assert error.param == "messages"
    assert 'tool turns (messages[1].tool_calls, messages[2] (role "tool"))' in error.message
    assert "Tool call IDs should be alphanumeric strings with length 9!" in error.message
    assert "does not support tool calling" in error.message and "chat_template" in error.message
    assert "--tool-call-parser mistral" in error.message
    # A template that refuses a tool role: Gemma-style alternation (no tool_calls in history)
    gemma_like = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/"
        "...') }}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    results = [SDK_HISTORY[0], {"role": "assistant", "content": "ok"}, SDK_HISTORY[0]]
    results.insert(2, SDK_HISTORY[2])
    with pytest.raises(InvalidRequestError) as info:
        render(processor, results, gemma_like)
    assert 'messages[2] (role "tool")' in info.value.message
    assert "roles must alternate" in info.value.message


def test_other_template_errors_are_left_as_they_are(processor):
    with pytest.raises(InvalidRequestError) as info:
        render(processor, SDK_HISTORY[:1], "{{ raise_exception('no system turn') }}")
    assert "cannot apply the chat template" in info.value.message
    assert "tool" not in info.value.message
