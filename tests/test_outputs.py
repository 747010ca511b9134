"""`top_two_margin`: how near a tie one position's choice was."""

from inferengine.outputs import Logprob, top_two_margin


def test_margin_is_rank_one_minus_rank_two_whatever_the_order():
    position = {7: Logprob(-2.5, rank=3), 4: Logprob(-0.25, rank=1), 9: Logprob(-1.0, rank=2)}
    assert top_two_margin(position) == 0.75


def test_margin_needs_both_top_ranks():
    assert top_two_margin({4: Logprob(-0.1, rank=1)}) is None
    assert top_two_margin({}) is None
