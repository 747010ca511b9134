"""`LLM.chat` with tools: earlier tool calls, their arguments JSON text as OpenAI's API carries
them, reach the chat template as dicts (as the server's chat path and vLLM hand them)."""

from __future__ import annotations

import copy

import pytest

from inferengine import LLM, SamplingParams
from inferengine.errors import InvalidRequestError
from tests.conftest import spy_core_requests
from tests.entrypoints.openai.test_tools_api import HISTORY, TOOL_TEMPLATE, WEATHER


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama3-tied")), max_model_len=512)


def test_tool_call_arguments_reach_the_template_as_dicts(llm, monkeypatch):
    sent = spy_core_requests(llm, monkeypatch)
    history = copy.deepcopy(HISTORY)
    llm.chat(
        history,
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        chat_template=TOOL_TEMPLATE,
        tools=[WEATHER],
    )
    (request,) = sent
    text = llm.get_tokenizer().decode(request.prompt_token_ids)
    # a dict rendered by tojson, not the JSON text quoted again
    assert '"arguments": {"city": "Paris", "unit": "c"}}</tool_call>' in text
    assert '"name": "get_weather", "description": "The weather in a city."' in text  # the tool
    assert history == HISTORY  # the caller's messages are left as given


@pytest.mark.parametrize(
    ("arguments", "says"),
    [('{"city": ', "not valid JSON"), ("[1, 2]", "must be a JSON object")],
)
def test_bad_tool_call_arguments_raise_before_anything_is_queued(llm, monkeypatch, arguments, says):
    sent = spy_core_requests(llm, monkeypatch)
    history = copy.deepcopy(HISTORY)
    history[1]["tool_calls"][0]["function"]["arguments"] = arguments
    with pytest.raises(InvalidRequestError, match=says) as info:
        llm.chat(history, use_tqdm=False, chat_template=TOOL_TEMPLATE, tools=[WEATHER])
    assert info.value.param == "messages[1].tool_calls[0].function.arguments"
    assert sent == [] and not llm.llm_engine.has_unfinished_requests()
