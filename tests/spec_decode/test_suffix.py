"""The suffix proposer drafts the most frequent continuation of a tail of the tokens seen
before, in the request's own tokens or in recently finished requests, the best-scoring match
winning."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from inferengine.config import SpeculativeConfig
from inferengine.spec_decode.suffix import SuffixProposer, _Leaf, _Node, _SuffixTrie


def proposer(
    k: int = 3,
    depth: int = 24,
    cached: int = 0,
    factor: float = 1.0,
    min_prob: float = 0.1,
) -> SuffixProposer:
    return SuffixProposer(
        SpeculativeConfig(
            "suffix",
            k,
            suffix_decoding_max_tree_depth=depth,
            suffix_decoding_max_cached_requests=cached,
            suffix_decoding_max_spec_factor=factor,
            suffix_decoding_min_token_prob=min_prob,
        )
    )


def test_continues_a_repeated_pattern():
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert proposer(k=3).propose(tokens) == [3, 4, 1]
    # The earlier occurrence runs into the present after 3 4 1 2: nothing is known beyond.
    assert proposer(k=8).propose(tokens) == [3, 4, 1, 2]
    assert proposer(k=3).propose([9, 8, 7, 9, 8]) == [7, 9]  # two matched, two drafts


def test_caps_from_max_drafts_num_speculative_tokens_and_spec_factor():
    tokens = [7, 1, 2, 3, 4, 5, 9, 1]  # the tail matches one token: "1" -> 2 3 4 5 9 1
    assert proposer(k=6, factor=8).propose(tokens) == [2, 3, 4, 5, 9, 1]
    assert proposer(k=4, factor=8).propose(tokens) == [2, 3, 4, 5]
    assert proposer(k=6, factor=8).propose(tokens, max_drafts=2) == [2, 3]
    assert proposer(k=6, factor=8).propose(tokens, max_drafts=0) == []
    assert proposer(k=6, factor=1).propose(tokens) == [2]
    assert proposer(k=6, factor=2.5).propose(tokens) == [2, 3]
    assert proposer(k=6, factor=0.5).propose(tokens) == []  # floor(0.5 * 1) = 0
    # A two-token match with factor 1.5 allows three drafts.
    assert proposer(k=6, factor=1.5).propose([7, 1, 2, 3, 4, 5, 9, 1, 2]) == [3, 4, 5]


def test_the_tree_depth_limits_the_match_and_the_path():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert proposer(k=8, depth=24, factor=8).propose(tokens) == [4, 5, 6, 1, 2, 3]
    # Depth 4: match + drafts stay within 4 tokens. "1 2 3" leaves room for 4, "2 3" for 4 5,
    # "3" for 4 5 6, which scores highest.
    assert proposer(k=8, depth=4, factor=8).propose(tokens) == [4, 5, 6]
    assert proposer(k=8, depth=2, factor=8).propose(tokens) == [4]  # "3" -> 4


def test_a_shorter_match_wins_where_the_longest_leaves_no_depth():
    # Depth 6: "2 1 2 1 2" (5 deep) leaves room for one draft; "2 1 2" leaves three.
    assert proposer(k=3, depth=6).propose([1, 2] * 6) == [1, 2, 1]


# After "5": 1 three times of four, then 8 two times of three, then 20 always, then 30 or 31.
BRANCHING = [5, 1, 8, 20, 30, 5, 1, 8, 20, 31, 5, 1, 9, 32, 5, 2, 33, 5]


@pytest.mark.parametrize(
    ("min_prob", "drafts"),
    [
        (0.8, []),  # 3/4 < 0.8
        (0.75, [1]),  # then 3/4 * 2/3 = 0.5
        (0.6, [1]),
        (0.5, [1, 8, 20]),  # 0.5 * 2/2 = 0.5, then 0.5 * 1/2 = 0.25
        (0.3, [1, 8, 20]),
        # A tie (30 or 31): the more recent continuation; then 31's one occurrence.
        (0.25, [1, 8, 20, 31, 5, 1]),
        (0.0, [1, 8, 20, 31, 5, 1]),
    ],
)
def test_min_token_prob_stops_the_path(min_prob, drafts):
    p = proposer(k=6, factor=8, min_prob=min_prob)
    assert p.propose(BRANCHING) == drafts


def test_the_most_frequent_continuation_wins():
    # After "4": 6 twice, 5 once; after "4 6": 0 or 2, a tie that the more recent wins.
    assert proposer(k=2, factor=2).propose([4, 6, 0, 4, 6, 2, 4, 5, 3, 4]) == [6, 2]
    assert proposer(k=2, factor=2).propose([4, 6, 0, 4, 6, 2, 4, 5, 3, 4, 6]) == [2, 4]


def test_empty_and_one_token_inputs_give_nothing():
    p = proposer()
    assert p.propose([]) == []
    assert p.propose([5], request_id="a") == []
    assert p.propose([5, 5], request_id="a") == [5]
    assert proposer(factor=2).propose(np.array([3, 1, 3], dtype=np.int64)) == [1, 3]


def test_the_global_cache_helps_a_request_that_repeats_an_earlier_output():
    p = proposer(k=3, cached=10, factor=2)
    prompt = [100, 101]
    output = [1, 2, 3, 4, 5, 6]
    for n in range(1, len(output) + 1):
        p.propose(prompt + output[:n], request_id="a")
    assert p.propose([200, 1, 2], request_id="b") == []  # "a" still runs
    p.finish("a")
    assert p.propose([200, 1, 2], request_id="b") == [3, 4, 5]
    assert p.propose([200, 1, 2, 3, 4], request_id="b") == [5, 6]
    assert p.propose([300, 9, 100], request_id="c") == [101, 1]  # the prompt is cached too
    # Given the prompt length, only the output is cached.
    q = proposer(k=3, cached=10, factor=2)
    q.finish("a", prompt + output, num_prompt_tokens=len(prompt))
    assert q.propose([300, 9, 100], request_id="c") == []
    assert q.propose([300, 1, 2], request_id="d") == [3, 4, 5]


def test_the_own_text_wins_over_the_cache_when_it_scores_higher():
    p = proposer(k=3, cached=10, factor=4)
    p.finish("a", [1, 2, 7, 8, 1, 2, 7, 9, 1, 2, 7, 6])  # after "1 2": 7, then 8 / 9 / 6
    assert p.propose([50, 1, 2], request_id="b") == [7, 6]  # cache: 1, 1/3 (the latest: 6)
    # Its own text saw "1 2 3 4" once: probability 1 all along.
    assert p.propose([1, 2, 3, 4, 50, 1, 2], request_id="c") == [3, 4, 50]
    assert p.finish("b") is None and p.finish("never-seen") is None


def test_no_cache_when_max_cached_requests_is_0():
    p = proposer(k=3, cached=0, factor=2)
    p.propose([1, 2, 3, 4], request_id="a")
    p.finish("a")
    p.finish("b", [1, 2, 3, 4])
    assert p.propose([9, 1, 2], request_id="c") == []


def test_eviction_removes_the_oldest_requests_contribution():
    p = proposer(k=1, cached=3)
    p.finish("a", [1, 2, 3])
    p.finish("b", [1, 2, 3])
    p.finish("c", [1, 2, 4])
    assert p.propose([9, 1, 2], request_id="x") == [3]  # 3 twice, 4 once
    p.finish("d", [1, 2, 4])  # evicts "a": 3 once, 4 twice
    assert p.propose([8, 1, 2], request_id="y") == [4]
    p.finish("e", [5, 6])  # evicts "b": 3 is gone
    p.finish("f", [5, 6])  # evicts "c"
    p.finish("g", [5, 6])  # evicts "d": nothing follows "1 2" any more
    assert p.propose([7, 1, 2], request_id="z") == []
    assert counts_in(p._global) == substring_counts([[5, 6]] * 3, 24)


def test_a_request_id_used_again_after_finish_starts_afresh():
    p = proposer(k=2, cached=5, factor=2)
    p.propose([1, 2, 3, 1], request_id="a")
    p.finish("a")
    p.finish("a", [7, 8, 9])  # the same id, cached separately
    assert len(p._cached) == 2
    assert p.propose([4, 1], request_id="a") == [2, 3]  # from the first "a"


def test_a_changed_or_shorter_list_rebuilds_the_index():
    p = proposer(k=3, factor=4)
    assert p.propose([1, 2, 3, 1], request_id="r") == [2, 3, 1]
    assert p.propose([4, 5, 6, 4], request_id="r") == [5, 6, 4]  # changed
    assert p.propose([4, 5, 4], request_id="r") == [5, 4]  # shorter
    assert p.propose([4, 5, 4, 7, 4], request_id="r") == [7, 4]  # grown again


# --- randomised checks against a brute-force count of every substring ---


def substring_counts(seqs: list[list[int]], depth: int) -> Counter:
    counts: Counter = Counter()
    for seq in seqs:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def counts_in(trie: _SuffixTrie) -> Counter:
    """Every path of the trie with its count; also checks each known `best`."""
    counts: Counter = Counter()

    def walk(node: _Node, path: tuple[int, ...]) -> None:
        if node.best is not None:
            top = node.children[node.best].count
            others = [c.count for k, c in node.children.items() if k != node.best]
            assert top >= node.second >= max(others, default=0)
        for token, child in node.children.items():
            here = (*path, token)
            counts[here] += child.count
            if type(child) is _Leaf:
                seq, origin = child.seq, child.origin
                for k in range(origin + len(here), min(origin + trie.depth, len(seq))):
                    here = (*here, seq[k])
                    counts[here] += 1
            else:
                assert child.count > 0
                walk(child, here)

    walk(trie.root, ())
    return counts


def greedy_drafts(
    tail: tuple[int, ...], counts: Counter, vocab: range, cap: int, min_prob: float, discount: int
) -> list[tuple[list[int], float]]:
    """Every draft that takes a most frequent child at each step (a tie branches), and its
    score, the sum of the path probabilities."""
    found: list[tuple[list[int], float]] = []

    def walk(path: tuple[int, ...], drafts: list[int], prob: float, score: float) -> None:
        children = {t: counts[(*path, t)] for t in vocab if counts[(*path, t)]}
        top = max(children.values(), default=0)
        step = prob * top / (counts[path] - (discount if path == tail else 0)) if top else 0.0
        if len(drafts) == cap or not top or step < min_prob:
            found.append((drafts, score))
            return
        for token, count in children.items():
            if count == top:
                walk((*path, token), [*drafts, token], step, score + step)

    walk(tail, [], 1.0, 0.0)
    return found


def check_best(
    drafts: list[int],
    tokens: list[int],
    counts: Counter,
    vocab: range,
    config: dict,
    discount: int,
) -> None:
    """`drafts` are the greedy drafts of some match that occurred before, scoring at least what
    the best match scores with the worst choices at ties and at most the best overall."""
    depth, k, factor = config["depth"], config["k"], config["factor"]
    options = []
    for m in range(1, min(len(tokens), depth - 1) + 1):
        tail = tuple(tokens[-m:])
        if not any(counts[(*tail, t)] for t in vocab):
            break
        cap = min(k, int(factor * m + 1e-6))
        if cap > 0:
            options.append(greedy_drafts(tail, counts, vocab, cap, config["min_prob"], discount))
    lowest = max((min(s for _, s in found) for found in options), default=0.0)
    highest = max((s for found in options for _, s in found), default=0.0)
    if not drafts:
        assert highest == 0.0
        return
    scores = [s for found in options for d, s in found if d == drafts]
    assert any(lowest - 1e-9 <= s <= highest + 1e-9 for s in scores), (drafts, options)


@pytest.mark.parametrize("seed", range(6))
def test_incremental_matches_a_fresh_index_and_the_brute_force_counts(seed):
    rng = random.Random(seed)
    vocab = range(rng.choice([2, 3, 4, 6]))
    depth = rng.choice([2, 3, 5, 8])
    config = dict(
        k=rng.choice([1, 3, 6]),
        depth=depth,
        factor=rng.choice([0.5, 1.0, 2.0]),
        min_prob=rng.random() / 2,
    )
    live = proposer(**config)
    tokens: list[int] = []
    while len(tokens) < 80:
        tokens += [rng.choice(vocab) for _ in range(rng.randint(1, 5))]
        drafts = live.propose(tokens, request_id="r")
        assert drafts == proposer(**config).propose(list(tokens), request_id="r")
        counts = substring_counts([tokens], depth)
        assert counts_in(live._requests["r"].trie) == counts
        check_best(drafts, tokens, counts, vocab, config, 1)


@pytest.mark.parametrize("seed", range(6))
def test_the_global_cache_matches_the_brute_force_counts_through_evictions(seed):
    rng = random.Random(seed)
    vocab = range(rng.choice([3, 4, 6]))
    depth = rng.choice([2, 3, 5, 8])
    cap_requests = rng.choice([1, 2, 4])
    config = dict(
        k=rng.choice([1, 3, 6]),
        depth=depth,
        factor=rng.choice([1.0, 2.0]),
        min_prob=rng.random() / 2,
    )
    p = proposer(**config, cached=cap_requests)
    finished: list[list[int]] = []
    for r in range(12):
        text = [rng.choice(vocab) for _ in range(rng.randint(1, 30))]
        p.propose(text[: rng.randint(0, len(text))], request_id=str(r))
        p.finish(str(r), text)
        finished.append(text)
        cached = finished[-cap_requests:]
        counts = substring_counts(cached, depth)
        assert counts_in(p._global) == counts
        # A context of distinct tokens has no match in its own text: any draft is the cache's.
        context = rng.sample(list(vocab), rng.randint(1, len(vocab)))
        drafts = p.propose(context, request_id=f"probe{r}")
        check_best(drafts, context, counts, vocab, config, 0)
    for r in range(12):
        p.finish(f"probe{r}")
    assert not p._requests


def test_a_probe_says_whether_propose_would_draft():
    p = SuffixProposer(SpeculativeConfig("suffix", 4))
    assert p.probe([1, 2, 3, 1, 2], "r") and not p.probe([1, 2, 3, 4, 5], "s")
    assert set(p._requests) == {"r", "s"}  # kept for the requests' later proposals
    assert p.probe([1, 2, 3, 1, 2]) and "" not in p._requests


def test_lookahead_drafts_follow_the_guess_for_the_token_on_its_way():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposer(k=8, factor=4.0).propose(tokens) == [3, 4, 5, 6, 1, 2]
    # 3 stands for the token on its way; k drafts follow it, within what the trie knows.
    assert proposer(k=3, factor=4.0).propose(tokens, lookahead=1) == [4, 5, 6]
    assert proposer(k=3, factor=4.0).propose(tokens, 2, lookahead=1) == [4, 5]
    assert proposer(k=8, factor=4.0).propose(tokens, lookahead=1) == [4, 5, 6, 1, 2]
