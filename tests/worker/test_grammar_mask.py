"""The packed grammar bitmask applied to a step's logits: -inf exactly at the tokens a request's
row forbids, at every one of its positions (drafts included), other requests' rows untouched."""

from __future__ import annotations

import numpy as np
import torch

from inferengine.worker.grammar_mask import apply_grammar_bitmask

VOCAB = 40  # two 32-bit words a row, the second one partly past the vocabulary


def pack(allowed_rows: list[set[int]], words: int = 2) -> bytes:
    packed = np.zeros((len(allowed_rows), words), dtype=np.uint32)
    for i, allowed in enumerate(allowed_rows):
        for token in allowed:
            packed[i, token // 32] |= np.uint32(1 << (token % 32))
    return packed.view(np.int32).tobytes()


def allowed_of(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row != float("-inf")).flatten().tolist())


def test_only_the_rows_of_grammar_requests_are_masked():
    logits = torch.arange(3 * VOCAB, dtype=torch.float32).view(3, VOCAB)
    before = logits.clone()
    apply_grammar_bitmask(logits, ["b"], pack([{0, 31, 32, 39}]), ["a", "b", "c"], [0, 0, 0])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert allowed_of(logits[1]) == {0, 31, 32, 39}  # bit 31: the sign bit of the word
    assert logits[1, 31] == before[1, 31]  # allowed logits keep their values


def test_every_position_of_a_drafting_request_has_its_own_row():
    # Sampling rows: a (no drafts) at logits row 0, b (2 drafts) at rows 1-3, c at row 4.
    logits = torch.zeros(5, VOCAB)
    masks = [{0, 33}, {1, 2}, {5, 39}, {31, 32}]  # c's row, then b's three, in grammar order
    apply_grammar_bitmask(logits, ["c", "b"], pack(masks), ["a", "b", "c"], [0, 2, 0])
    assert allowed_of(logits[0]) == set(range(VOCAB))
    assert [allowed_of(logits[i]) for i in (4, 1, 2, 3)] == masks


def test_a_row_that_allows_nothing_masks_everything():
    logits = torch.randn(1, VOCAB)
    apply_grammar_bitmask(logits, ["a"], pack([set()]), ["a"], [0])
    assert torch.isneginf(logits).all()
