"""The n-gram proposer continues the most recent earlier occurrence of the longest matching tail."""

from __future__ import annotations

import pytest

from inferengine.config import SpeculativeConfig
from inferengine.errors import ConfigError
from inferengine.spec_decode.ngram import NgramProposer


def proposer(k: int = 3, lo: int = 1, hi: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, lo, hi))


def test_continues_the_earlier_occurrence_of_the_tail():
    # ... 5 6 7 8 9 ... 5 6 -> 7 8 9
    assert proposer().propose([1, 5, 6, 7, 8, 9, 2, 5, 6]) == [7, 8, 9]


def test_the_longest_tail_wins_over_a_more_recent_short_match():
    tokens = [4, 5, 6, 10, 11, 9, 6, 20, 21, 4, 5, 6]
    # tail "4 5 6" occurs at the start (-> 10 11 9); "6" alone occurs later (-> 20 21 4)
    assert proposer(hi=3).propose(tokens) == [10, 11, 9]
    assert proposer(hi=1).propose(tokens) == [20, 21, 4]


def test_the_most_recent_occurrence_of_equal_length():
    assert proposer(k=2, lo=2, hi=2).propose([7, 8, 1, 1, 7, 8, 2, 2, 7, 8]) == [2, 2]


def test_no_match_shorter_than_min_and_caps():
    assert proposer(lo=2).propose([1, 2, 3, 4, 1]) == []  # only a 1-token match
    assert proposer(lo=1).propose([1, 2, 3, 4, 1]) == [2, 3, 4]
    assert proposer(k=2).propose([1, 2, 3, 4, 1]) == [2, 3]
    assert proposer().propose([1, 2, 3, 4, 1], max_drafts=1) == [2]
    assert proposer().propose([1, 2, 3, 4, 1], max_drafts=0) == []
    assert proposer().propose([9]) == [] and proposer().propose([]) == []


def test_a_continuation_that_reaches_the_end_copies_itself_periodically():
    assert proposer(k=5).propose([3, 4, 9, 3, 4]) == [9, 3, 4, 9, 3]
    assert proposer(k=4, lo=1, hi=2).propose([0, 0, 0]) == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "must be at least 1"),
        ({"method": "ngram", "num_speculative_tokens": -1}, "must be at least 1"),
        ({"num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 3, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "<="),
        ({"method": "medusa", "num_speculative_tokens": 3}, "unknown speculative method"),
        ({"method": "eagle3", "num_speculative_tokens": 3}, "not supported yet"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, 'needs "model"'),
        ({"num_speculative_tokens": 3, "model": "/m"}, "do not apply to method 'ngram'"),
        ({"method": "suffix", "prompt_lookup_max": 3}, "do not apply to method 'suffix'"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, r"in \[0, 1\]"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 3, "lookahead": 2}, "unknown keys"),
    ],
)
def test_bad_configs_say_what_to_change(values, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_dict(values)


def test_suffix_defaults_to_the_tree_depth_as_vllm_does():
    config = SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 8})
    assert config.num_speculative_tokens == 8


def _lookup_from_scratch(tokens, k, lo, hi):
    """The definition: the most recent earlier occurrence of the longest matching tail."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                text = list(tokens)
                for i in range(k):  # continues periodically past the end
                    text.append(text[start + n + i])
                return text[len(tokens) : len(tokens) + k]
    return []


@pytest.mark.parametrize("seed", range(5))
def test_the_incremental_index_proposes_what_a_fresh_lookup_does(seed):
    import random

    rng = random.Random(seed)
    p = proposer(k=4, lo=2, hi=4)
    tokens = [rng.randrange(6) for _ in range(5)]
    for _ in range(60):
        assert p.propose(tokens, request_id="r") == _lookup_from_scratch(tokens, 4, 2, 4)
        tokens += [rng.randrange(6) for _ in range(rng.randint(1, 5))]
    p.finish("r")
    assert p._indexes == {}


@pytest.mark.parametrize("lo", [1, 2, 3])
def test_a_probe_says_whether_propose_would_draft_and_keeps_nothing(lo):
    import random

    rng = random.Random(lo)
    p = proposer(k=4, lo=lo, hi=5)
    hits = 0
    for _ in range(300):
        tokens = [rng.randrange(5 - lo) for _ in range(rng.randint(0, 14))]
        expected = bool(_lookup_from_scratch(tokens, 4, lo, 5))
        assert p.probe(tokens) is expected, tokens
        hits += expected
    assert 30 < hits < 270  # both answers were exercised
    assert p._indexes == {}


def test_lookahead_drafts_follow_the_guess_for_the_token_on_its_way():
    tokens = [1, 5, 6, 7, 8, 9, 2, 5, 6]  # -> 7 8 9 2 5 ...
    assert proposer(k=3).propose(tokens, lookahead=1) == [8, 9, 2]  # 7 stands for the token
    assert proposer(k=3).propose(tokens, 2, lookahead=1) == [8, 9]
    assert proposer(k=3).propose([1, 2, 3, 4, 1], lookahead=1) == [3, 4, 1]
    assert proposer(k=3).propose([1, 2, 3], lookahead=1) == []  # nothing to guess from
