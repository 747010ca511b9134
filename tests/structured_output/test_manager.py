"""`StructuredOutputManager` row by row, on the tiny tokenizer: rows for drafts, rows filled in
parallel equal rows filled one at a time, a compiled grammar is copied (not shared) between
requests, and a reasoning model's grammar starts after its end token, also mid-draft."""

from __future__ import annotations

import numpy as np
import pytest

from inferengine.core.request import Request
from inferengine.sampling_params import SamplingParams, StructuredOutputsParams
from inferengine.structured_output.manager import StructuredOutputManager
from tests.conftest import EOS_ID, VOCAB_SIZE

REGEX = r"[0-9]{3}-[a-z]{2}"


@pytest.fixture
def manager(tiny_checkpoint):
    m = StructuredOutputManager(str(tiny_checkpoint("qwen3")), VOCAB_SIZE)
    yield m
    m.shutdown()


def _request(req_id: str, structured: StructuredOutputsParams, prompt=(5, 6, 7)) -> Request:
    params = SamplingParams(max_tokens=20, structured_outputs=structured)
    request = Request(req_id, list(prompt), params, EOS_ID)
    request.num_computed_tokens = request.num_tokens  # ready to sample
    return request


def _ready(manager: StructuredOutputManager, *requests: Request) -> dict[str, Request]:
    for r in requests:
        manager.submit(r)
    while manager.waiting:
        manager.wait(1.0)
        _, failed = manager.take_ready()
        assert not failed
    return {r.request_id: r for r in requests}


def _allowed(mask: bytes, row: int, width: int = (VOCAB_SIZE + 31) // 32) -> set[int]:
    words = np.frombuffer(mask, np.int32).reshape(-1, width)[row]
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB_SIZE]
    return set(np.flatnonzero(bits).tolist())


def _token(manager: StructuredOutputManager, text: str) -> int:
    from inferengine.tokenizer import load_tokenizer

    (token_id,) = load_tokenizer(manager.tokenizer_path).encode(text, add_special_tokens=False)
    return token_id


def test_rows_filled_in_parallel_equal_rows_filled_alone(manager):
    structured = StructuredOutputsParams(regex=REGEX)
    requests = _ready(manager, *(_request(f"r{i}", structured) for i in range(4)))
    manager.accept("r1", [_token(manager, "1")])
    manager.accept("r2", [_token(manager, "1"), _token(manager, "2"), _token(manager, "3")])
    rows, together = manager.bitmask(list(requests), requests, {})
    assert rows == ["r0", "r1", "r2", "r3"]
    for i, req_id in enumerate(rows):
        _, alone = manager.bitmask([req_id], requests, {})
        assert _allowed(together, i) == _allowed(alone, 0)
    digits = {_token(manager, d) for d in "0123456789"}
    assert _allowed(together, 0) <= digits and _allowed(together, 0)
    assert _token(manager, "-") in _allowed(together, 2)
    assert _allowed(together, 3) == _allowed(together, 0)  # r3 did not move with r1, r2


def test_a_compiled_grammar_is_copied_not_shared(manager):
    structured = StructuredOutputsParams(regex=REGEX)
    _ready(manager, _request("a", structured))
    _ready(manager, _request("b", structured))
    assert len(manager._compiled) == 1
    assert manager.matchers["a"] is not manager.matchers["b"]
    took, _ = manager.accept("a", [_token(manager, "1")])
    assert took
    assert not manager.matchers["b"].is_stopped()
    took, _ = manager.accept("b", [_token(manager, "x")])
    assert not took  # b is still at the start, where a letter is refused


def test_draft_rows_follow_the_grammar_and_allow_all_after_a_refused_draft(manager):
    requests = _ready(manager, _request("r", StructuredOutputsParams(regex=REGEX)))
    one, x = _token(manager, "1"), _token(manager, "x")
    rows, mask = manager.bitmask(["r"], requests, {"r": [one, x, one]})
    assert rows == ["r"]
    assert x not in _allowed(mask, 0) and one in _allowed(mask, 0)
    assert one in _allowed(mask, 1)  # after "1": a digit
    assert len(_allowed(mask, 2)) == VOCAB_SIZE  # "x" refused: the verifier rejects there
    assert len(_allowed(mask, 3)) == VOCAB_SIZE
    assert one in _allowed(manager.bitmask(["r"], requests, {})[1], 0)  # walked back


def test_a_reasoning_grammar_starts_after_the_end_token_even_mid_draft(manager):
    end, start = _token(manager, "!"), 3
    structured = StructuredOutputsParams(
        regex=REGEX, reasoning_start_token_id=start, reasoning_end_token_id=end
    )
    requests = _ready(
        manager,
        _request("thinking", structured),
        _request("closed", structured, prompt=(start, 9, end, 5)),
    )
    assert set(manager.reasoning) == {"thinking"}
    rows, _ = manager.bitmask(["thinking", "closed"], requests, {})
    assert rows == ["closed"]  # no row while it reasons
    x, one = _token(manager, "x"), _token(manager, "1")
    rows, mask = manager.bitmask(["thinking"], requests, {"thinking": [x, end, one]})
    assert rows == ["thinking"]
    assert len(_allowed(mask, 0)) == len(_allowed(mask, 1)) == VOCAB_SIZE  # still reasoning
    assert x not in _allowed(mask, 2) and one in _allowed(mask, 2)  # the grammar's first row
    assert one in _allowed(mask, 3)
    assert manager.accept("thinking", [x, x]) == (True, False)  # reasoning: not fed
    assert manager.accept("thinking", [x, end, one]) == (True, False)
    assert "thinking" not in manager.reasoning
    assert manager.accept("thinking", [x]) == (False, True)  # now the grammar holds


def test_a_tokenizer_larger_than_the_vocabulary_still_gets_masks(tiny_checkpoint):
    """The tiny qwen2 tokenizer adds a pad token past the model's 320 ids: masks cover the
    tokenizer (the worker cuts them to the logits)."""
    manager = StructuredOutputManager(str(tiny_checkpoint("qwen2")), VOCAB_SIZE)
    try:
        requests = _ready(manager, _request("r", StructuredOutputsParams(regex=REGEX)))
        rows, mask = manager.bitmask(["r"], requests, {})
        assert rows == ["r"] and manager.words * 32 > VOCAB_SIZE
        assert _token(manager, "1") in _allowed(mask, 0, manager.words)
    finally:
        manager.shutdown()
