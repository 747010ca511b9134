"""The whole tool loop through `inferengine serve` and the official `openai` client, as an agent
runs it: tools offered, the model calls one, the SDK's own assistant message (`content: null`
beside `tool_calls`) appended as it came back, the tool's result as a `role: "tool"` message with
its `tool_call_id`, and a final answer; streamed and not.

One server per template style, the real template in the tokenizer (`tests/entrypoints/
chat_templates/`) and the matching `--tool-call-parser`: Qwen2.5 (hermes), Llama 3.1 (llama3_json),
Mistral 7B v0.3 (mistral, whose 9-character call ids its template insists on). The tiny random
model never calls a tool by itself, so the first turn names the function (the grammar makes the
reply a call) and the second leaves tool_choice "auto", as an agent does. Also the 400 a model
whose template has no tool support gives."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import build_checkpoint, build_tokenizer
from tests.entrypoints.openai.server import API_KEY, SERVED_NAME, RemoteServer
from tests.entrypoints.openai.test_tools_api import TOOL_TEMPLATE
from tests.entrypoints.test_chat_messages import load_template

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},  # short, for the tiny context
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
RESULT = "sunny, 21 degrees"
# template -> (--tool-call-parser, the template's markers as special tokens, as in the real
# tokenizers; they also keep the prompt inside the tiny context)
STYLES = {
    "qwen2_5": ("hermes", ("<|im_start|>", "<|im_end|>")),
    "llama3_1": ("llama3_json", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "mistral_v0_3": (
        "mistral",
        ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]"),
    ),
}


def rendered_turns(style: str, call_id: str, arguments: dict[str, Any]) -> tuple[str, str]:
    """How the style's template writes the earlier call and the tool's result."""
    args = json.dumps(arguments, ensure_ascii=False)
    if style == "qwen2_5":
        call = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
        return call, f"<tool_response>\n{RESULT}\n</tool_response>"
    if style == "llama3_1":
        return (
            f'{{"name": "get_weather", "parameters": {args}}}<|eot_id|>',
            f'<|start_header_id|>ipython<|end_header_id|>\n\n"{RESULT}"<|eot_id|>',
        )
    call = f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {args}, "id": "{call_id}"}}]'
    return call, f'[TOOL_RESULTS] {{"content": {RESULT}, "call_id": "{call_id}"}}[/TOOL_RESULTS]'


@dataclass
class Styled:
    style: str
    server: RemoteServer
    client: openai.OpenAI
    sent: list[dict[str, Any]] = field(default_factory=list)  # request bodies, as on the wire


@pytest.fixture(scope="module", params=sorted(STYLES))
def styled(request, tmp_path_factory):
    style = request.param
    parser, specials = STYLES[style]
    folder = build_checkpoint("qwen3", tmp_path_factory.mktemp(style))
    tokenizer = build_tokenizer(specials)
    tokenizer.chat_template = load_template(style)
    tokenizer.save_pretrained(folder)
    server = RemoteServer(
        folder,
        "--max-model-len",
        "1024",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        parser,
    )
    sent: list[dict[str, Any]] = []

    def keep_body(req: httpx.Request) -> None:
        sent.append(json.loads(req.content))

    http = httpx.Client(event_hooks={"request": [keep_body]}, timeout=120)
    try:
        server.wait_ready()
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, http_client=http
        )
        yield Styled(style, server, client, sent)
    finally:
        http.close()
        server.stop()


def create(client: openai.OpenAI, messages: list[Any], **kwargs: Any) -> Any:
    fields = {"temperature": 1.0, "seed": 7, "max_tokens": 40, **kwargs}
    return client.chat.completions.create(
        model=SERVED_NAME, messages=messages, tools=TOOLS, **fields
    )


def streamed_turn(client: openai.OpenAI, messages: list[Any], **kwargs: Any):
    """The streamed reply gathered as clients gather it: (the assistant message to send back,
    finish_reason)."""
    content, calls, reason = "", {}, None
    for chunk in create(client, messages, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(
                    call.index,
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["id"] = call.id or slot["id"]
                slot["function"]["name"] += call.function.name or ""
                slot["function"]["arguments"] += call.function.arguments or ""
            reason = choice.finish_reason or reason
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, reason


def check_call(style: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    assert name == "get_weather"
    if style == "mistral_v0_3":
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id), call_id
    else:
        assert call_id.startswith("call_"), call_id
    args = json.loads(arguments)
    jsonschema.validate(args, CITY)
    return args


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_round_trip(styled, stream):
    client = styled.client
    messages: list[Any] = [QUESTION]
    # 1. the call
    if stream:
        assistant, reason = streamed_turn(client, messages, tool_choice=NAMED)
        (call,) = assistant["tool_calls"]
        call_id, fn = call["id"], call["function"]
        args = check_call(styled.style, call_id, fn["name"], fn["arguments"])
    else:
        choice = create(client, messages, tool_choice=NAMED).choices[0]
        assistant, reason = choice.message, choice.finish_reason  # the SDK's own object
        assert assistant.content is None
        (call,) = assistant.tool_calls
        call_id = call.id
        args = check_call(styled.style, call_id, call.function.name, call.function.arguments)
    assert reason == "tool_calls"
    # 2. the SDK's assistant message and the tool's result, back to the server
    # (streamed: the result as a list of text parts, which the template gets joined)
    result = [{"type": "text", "text": RESULT}] if stream else RESULT
    messages += [assistant, {"role": "tool", "tool_call_id": call_id, "content": result}]
    if stream:
        answer, reason = streamed_turn(client, messages, max_tokens=16)
        content, calls = answer["content"], answer.get("tool_calls")
    else:
        final = create(client, messages, max_tokens=16)
        content, calls, reason = (
            final.choices[0].message.content,
            final.choices[0].message.tool_calls,
            final.choices[0].finish_reason,
        )
    # 3. the final answer: text (tool_choice "auto": the random model writes no call)
    assert reason in ("stop", "length") and not calls
    assert isinstance(content, str) and content
    # the wire carried the assistant turn as the SDK holds it: null content beside the call
    sent = styled.sent[-1]["messages"]
    assert sent[1]["content"] is None and sent[1]["tool_calls"][0]["id"] == call_id
    assert sent[2] == {"role": "tool", "tool_call_id": call_id, "content": result}
    # and the template wrote both into the prompt, in its own format
    with styled.server.client() as http:
        tokens = http.post("/tokenize", json={"messages": sent, "tools": TOOLS}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    call_text, result_text = rendered_turns(styled.style, call_id, args)
    assert call_text in text and result_text in text, text
    if not stream:
        assert final.usage.prompt_tokens == len(tokens)


def test_template_without_tool_support_is_a_clear_400(openai_client):
    # The shared tiny server's template writes role and content only: earlier calls would vanish
    # from the prompt, so the round trip is refused, OpenAI-shaped, saying what to do.
    history = [
        QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    ]
    with pytest.raises(openai.BadRequestError) as info:
        create(openai_client, history, tool_choice="none")
    error = info.value.body
    assert info.value.status_code == 400
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "messages[1].tool_calls"
    assert "does not support tool calling" in error["message"]
    assert "chat_template" in error["message"]
    # a tool-use template sent with the request serves the same conversation
    reply = create(
        openai_client,
        history,
        tool_choice="none",
        max_tokens=4,
        extra_body={"chat_template": TOOL_TEMPLATE},
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert not reply.choices[0].message.tool_calls


def test_mistral_template_wants_its_own_call_ids(openai_client):
    # Without --tool-call-parser mistral, call ids are OpenAI's (call_...), which Mistral's
    # template refuses: a 400 that says which turns and why, not a bare template error.
    choice = create(
        openai_client,
        [QUESTION],
        tool_choice=NAMED,
        extra_body={"chat_template": load_template("mistral_v0_3")},
    ).choices[0]
    (call,) = choice.message.tool_calls
    history = [
        QUESTION,
        choice.message,
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    with pytest.raises(openai.BadRequestError) as info:
        create(
            openai_client,
            history,
            tool_choice="none",
            extra_body={"chat_template": load_template("mistral_v0_3")},
        )
    message = info.value.body["message"]
    assert "Tool call IDs should be alphanumeric strings with length 9!" in message
    assert 'messages[1].tool_calls, messages[2] (role "tool")' in message
    assert "--tool-call-parser mistral" in message
