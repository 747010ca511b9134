"""run-batch passes each row's session fields and `cache_control` breakpoints to the engine core."""

from __future__ import annotations

import pytest

from inferengine.core.engine_io import EngineCoreRequest
from tests.conftest import spy_core_requests
from tests.entrypoints.batch.helpers import openai_line, read_jsonl, run, write_jsonl


@pytest.fixture
def sent(batch_llm, monkeypatch) -> list[EngineCoreRequest]:
    return spy_core_requests(batch_llm, monkeypatch)


def test_rows_carry_their_retention(batch_llm, sent, tmp_path):
    messages = [
        {
            "role": "system",
            "content": [
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}
            ],
        },
        {"role": "user", "content": "Where is Paris?"},
    ]
    lines = [
        openai_line("c", {"prompt": "Hello", "max_tokens": 1, "prompt_cache_key": "k1", "prompt_cache_retention": "1h"}),
        openai_line("m", {"messages": messages, "max_tokens": 1, "prompt_cache_key": "k2"}),
        openai_line("bad", {"prompt": "Hello", "max_tokens": 1, "prompt_cache_retention": "1 year"}),
    ]  # fmt: skip
    summary = run(batch_llm, write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl")
    assert (summary.done, summary.failed) == (2, 1)
    by_key = {r.cache_key: r for r in sent}
    assert sorted(by_key) == ["k1", "k2"]
    assert (by_key["k1"].cache_ttl_s, by_key["k1"].cache_breakpoints) == (3600.0, [])
    chat = by_key["k2"]
    assert chat.cache_ttl_s is None
    ((num_tokens, ttl_s),) = chat.cache_breakpoints
    assert ttl_s == 300.0 and 0 < num_tokens < len(chat.prompt_token_ids)
    bad = next(r for r in read_jsonl(tmp_path / "out.jsonl") if r["custom_id"] == "bad")
    error = bad["response"]["body"]["error"]
    assert bad["response"]["status_code"] == 400
    assert error["param"] == "prompt_cache_retention"
