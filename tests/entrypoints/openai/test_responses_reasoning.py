"""Reasoning on `/v1/responses` through the official `openai` client: a server with the
deepseek_r1 reasoning parser (a reply is reasoning until `</think>`, which the tiny random model
never writes, so the whole reply is reasoning) answers with a `reasoning` item, streamed as
`response.reasoning_text.*` events, its tokens counted in `reasoning_tokens`; the item goes back
to the template as the assistant turn's reasoning on a follow-up. What the parser cannot do
(turn thinking off, start a grammar after `</think>` without such a token) is a 400 naming the
Responses field."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.server import SERVED_NAME
from tests.entrypoints.openai.test_responses import events_of, open_app


@pytest.fixture(scope="module")
def app(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("responses-r1")
    with open_app(tiny_checkpoint, folder, reasoning_parser="deepseek_r1") as app:
        yield app


def test_reasoning_streams_as_a_reasoning_item(app):
    stream = app.client.responses.create(
        model=SERVED_NAME,
        input="Why is the sky blue?",
        reasoning={"effort": "medium", "summary": "auto"},
        max_output_tokens=5,
        stream=True,
    )
    events = events_of(stream)
    types = [e.type for e in events]
    num_deltas = types.count("response.reasoning_text.delta")
    assert num_deltas >= 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * num_deltas,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # cut off at max_output_tokens, still reasoning
    ]
    added, part_added = events[2:4]
    assert added.item.type == "reasoning" and part_added.part.type == "reasoning_text"
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert events[-4].text == text
    final = events[-1].response
    (item,) = final.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
    assert item.content[0].text == text and item.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.reasoning.effort == "medium"
    usage = final.usage
    assert usage.output_tokens == 5 and usage.output_tokens_details.reasoning_tokens == 5
    # the follow-up renders the reasoning as the assistant turn's (Qwen2.5's template drops it,
    # as templates do for earlier turns) and answers after it
    follow_up = app.client.responses.create(
        model=SERVED_NAME, input="Go on.", previous_response_id=final.id, max_output_tokens=3
    )
    assert [i.type for i in follow_up.output] == ["reasoning"]
    assert follow_up.usage.input_tokens_details.cached_tokens >= 16
    assert "<|im_start|>user\nGo on.<|im_end|>" in app.prompt_text(app.sent[-1])


def test_what_the_reasoning_parser_cannot_do_is_a_400(app):
    with pytest.raises(openai.BadRequestError) as e:
        app.client.responses.create(
            model=SERVED_NAME, input="hi", reasoning={"effort": "none"}, max_output_tokens=1
        )
    assert e.value.body["param"] == "reasoning.effort"
    assert "cannot turn the model's thinking off" in e.value.body["message"]
    # structured output starts after </think>, which this tokenizer has no single token for
    with pytest.raises(openai.BadRequestError) as e:
        app.client.responses.create(
            model=SERVED_NAME,
            input="hi",
            text={"format": {"type": "json_object"}},
            max_output_tokens=1,
        )
    assert e.value.body["param"] == "text.format"
    assert "Leave out text.format" in e.value.body["message"]
