"""An event's JSON stays on one line for any line reader: generated text holding characters
that `str.splitlines` breaks on (httpx's `aiter_lines` among them) is written escaped."""

from __future__ import annotations

import json

from pydantic import BaseModel

from inferengine.entrypoints.openai.serving_engine import sse


class _Event(BaseModel):
    text: str


def test_line_breaking_characters_are_escaped_and_round_trip():
    text = "a\u2028b\x85c\x1cd\u2029e\x1d\x1e é \n end"
    event = sse(_Event(text=text))
    assert event.startswith("data: ") and event.endswith("\n\n")
    lines = event[:-2].splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0][len("data: ") :])["text"] == text
