"""Suffix-decoding proposer: draft what most often followed the request's latest tokens, in its
own text so far or in recently finished requests (the idea of Arctic Inference's SuffixDecoding).

Two suffix tries, each over every substring of at most D = `suffix_decoding_max_tree_depth`
tokens of the texts it indexes, with a count per node: how many start positions have that
substring as a prefix of their (depth-limited) suffix.

- Per request: the request's prompt and output so far. `propose` gets the whole list each step
  and indexes only the tokens it has not seen (O(D) per new token, nothing per old token).
- Global: the texts of up to `suffix_decoding_max_cached_requests` finished requests (0: none),
  the oldest removed, count by count, when a newer one pushes the total over the cap.
  `finish` moves a request there. What it caches: the tokens passed to `finish` (or those the
  last `propose` saw) after the first `num_prompt_tokens`. Arctic caches outputs only, and so
  should the engine (it knows the prompt length): a prompt mostly repeats the system prompt and
  earlier turns, whose counts would then drown the responses', and it costs memory for text
  the request's own trie already holds. Without a prompt length the whole list is cached.

Proposal: from a suffix of the tokens (at most D - 1 of them) that occurred before, follow the
most frequent child (ties: the one that most recently reached its count; after an eviction,
any), multiplying child count / node count into the path probability and stopping before it
falls below `suffix_decoding_min_token_prob`. In the request's own trie the matched node counts
one less: the tail's own occurrence is the one whose continuation is unknown. At most
min(max_drafts, num_speculative_tokens, floor(max_spec_factor * match length)) drafts, and
match + drafts <= D. A draft scores the sum of its path probabilities (the expected number of
accepted tokens were the counts the truth). Every match length is a candidate, in the
request's trie and then the global one, and the best score wins (ties: the one tried first,
and the request's own trie). Like Arctic, and not only the longest match: that one may leave
no depth to draft in (a tail seen many times matches D - 1 tokens deep, leaving one draft),
and its counts are the smallest. A candidate is skipped when its length bound cannot beat the
best score so far (n drafts score at most n); trying first the longest match that leaves depth
for all the drafts settles most calls with one or two walks.

Memory stays near linear in the indexed tokens: a path that only one start position takes is
kept as a leaf pointing into that text (not one node per token), so nodes exist only for
substrings seen at least twice (or, in the cache, seen twice before an eviction), plus one leaf
per start position. Text that repeats a lot still costs up to D nodes per token.

Hot path: the engine core calls `propose` for every speculating request each step; keep it
O(D) per new token and O(D log D) per call, with nothing that walks the whole request.
"""

from __future__ import annotations

from collections.abc import Sequence

from inferengine.config import SpeculativeConfig


class _Node:
    """`count` start positions pass through or end here. `best` is the key of a child with the
    highest count (None: unknown until `_rescan`); `second` bounds the other children's."""

    __slots__ = ("best", "children", "count", "second")

    def __init__(self, count: int):
        self.count = count
        self.children: dict[int, _Node | _Leaf] = {}
        self.best: int | None = None
        self.second = 0


class _Leaf:
    """The rest of the suffix path of one start position (`seq[origin:]`) that no other path
    shares, so count 1 all along: below a node at depth d it holds the tokens
    `seq[origin + d : min(origin + D, len(seq))]`. Grows with `seq` without being touched."""

    __slots__ = ("origin", "seq")
    count = 1

    def __init__(self, seq: list[int], origin: int):
        self.seq = seq
        self.origin = origin


def _raised(node: _Node, key: int, count: int) -> None:
    """The child `key` of `node` was added or counted up to `count`."""
    best = node.best
    if best == key:
        return
    if best is None:  # unknown: leave it to _rescan, unless this is the only child
        if len(node.children) == 1:
            node.best, node.second = key, 0
        return
    top = node.children[best].count
    if count >= top:  # the latest to reach the top count wins a tie
        node.best, node.second = key, top
    elif count > node.second:
        node.second = count


def _lowered(node: _Node, key: int, count: int) -> None:
    """The child `key` of `node` was counted down to `count` (0: removed)."""
    if node.best == key and (count == 0 or count < node.second):
        node.best = None


def _rescan(node: _Node) -> int:
    children = node.children
    # max() keeps the first of equals; reversed so that the child added last wins a tie.
    best = max(reversed(children.keys()), key=lambda key: children[key].count)
    node.best = best
    node.second = max((c.count for k, c in children.items() if k != best), default=0)
    return best


class _SuffixTrie:
    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node(0)

    def extend(self, seq: list[int], begin: int, frontier: list[_Node]) -> list[_Node]:
        """Index `seq[begin:]`, already appended to `seq`, whose earlier tokens are indexed.

        `frontier[d - 1]` is the node of the last d tokens, for d = 1 .. the longest suffix
        that occurred before (and below D); longer suffixes lie in their own leaves, which
        grow with `seq` by themselves. Returns the frontier after the last token.
        """
        depth, root = self.depth, self.root
        leaf_type, node_type, raised = _Leaf, _Node, _raised  # locals: this loop is the hot one
        for i in range(begin, len(seq)):
            token = seq[i]
            nodes = [root, *frontier]
            frontier = []
            append = frontier.append
            for d, node in enumerate(nodes):
                children = node.children
                child = children.get(token)
                if child is None:
                    # First sight of this suffix, so of every longer one too: one leaf each.
                    for d2 in range(d, len(nodes)):
                        parent = nodes[d2]
                        parent.children[token] = leaf_type(seq, i - d2)
                        raised(parent, token, 1)
                    break
                if type(child) is leaf_type:
                    # A second path takes the leaf's first token: make it a node of count 2.
                    split = node_type(2)
                    origin = child.origin
                    after = origin + d + 1
                    if after < origin + depth and after < len(child.seq):
                        key = child.seq[after]
                        split.children[key] = child
                        split.best = key
                    children[token] = child = split
                else:
                    child.count += 1
                if node.best != token:
                    raised(node, token, child.count)
                append(child)
            if len(frontier) == depth:  # a node at depth D has no children to grow
                frontier.pop()
        return frontier

    def remove(self, seq: list[int]) -> None:
        """Take back what `extend(seq, 0, [])` added."""
        depth, n = self.depth, len(seq)
        for start in range(n):
            node = self.root
            for k in range(start, min(start + depth, n)):
                token = seq[k]
                children = node.children
                child = children[token]
                if child.count == 1:  # only this path is left below: drop it all
                    del children[token]
                    _lowered(node, token, 0)
                    break
                child.count -= 1
                _lowered(node, token, child.count)
                node = child

    def locate(self, tokens: list[int], start: int) -> _Node | list[int] | None:
        """Where `tokens[start:]` ends in the trie, if it occurred with a continuation: its
        node, or the rest of the leaf it ends in."""
        node = self.root
        for d, token in enumerate(tokens[start:], 1):
            child = node.children.get(token)
            if child is None:
                return None
            if type(child) is _Leaf:
                seq, origin = child.seq, child.origin
                at = origin + len(tokens) - start  # in seq, just after the pattern
                end = min(origin + self.depth, len(seq))
                if at >= end or seq[origin + d : at] != tokens[start + d :]:
                    return None
                return seq[at:end]
            node = child
        return node if node.children else None


class _RequestIndex:
    __slots__ = ("frontier", "tokens", "trie")

    def __init__(self, depth: int):
        self.tokens: list[int] = []
        self.frontier: list[_Node] = []
        self.trie = _SuffixTrie(depth)


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.depth = config.suffix_decoding_max_tree_depth
        self._requests: dict[str, _RequestIndex] = {}
        self._global = _SuffixTrie(self.depth)
        # Cached texts, oldest first, under a serial number (request ids may come back).
        self._cached: dict[int, list[int]] = {}
        self._serial = 0

    def propose(
        self,
        token_ids: Sequence[int],
        max_drafts: int | None = None,
        request_id: str = "",
        lookahead: int = 0,
    ) -> list[int]:
        """Draft tokens to follow `token_ids`, the prompt and output so far of `request_id`
        (maybe none); at most `max_drafts` if given, after `lookahead` guessed tokens (see
        `TokenProposer`). Each call should pass the same list, grown; a shorter or different
        one (first and last seen tokens are checked) restarts the request's index."""
        c = self.config
        limit = c.num_speculative_tokens
        if max_drafts is not None:
            limit = min(limit, max_drafts)
        index = self._sync(request_id, token_ids)
        if limit <= 0:
            return []
        limit += lookahead
        drafts: list[int] = []
        score = 0.0
        frontier = index.frontier
        for match in self._match_order(len(frontier), limit):
            cap = self._cap(limit, match)
            if min(cap, self.depth - match) > score:  # else it cannot score higher
                found, found_score = self._follow(frontier[match - 1], match, cap, 1)
                if found_score > score:
                    drafts, score = found, found_score
        if self._cached and score < limit:
            found, found_score = self._propose_global(index.tokens, limit, score)
            if found_score > score:
                drafts = found
        return drafts[lookahead:]

    def probe(self, token_ids: Sequence[int], request_id: str = "") -> bool:
        """Whether `propose` would draft now: the request's index is built (and kept for its
        later proposals), so the first probe of a long text is not cheap."""
        found = bool(self.propose(token_ids, 1, request_id))
        if not request_id:
            self._requests.pop("", None)
        return found

    def finish(
        self, request_id: str, token_ids: Sequence[int] | None = None, num_prompt_tokens: int = 0
    ) -> None:
        """The request ended: drop its index and cache its text for later requests.

        `token_ids`: its final tokens (default: those the last `propose` saw); only those after
        the first `num_prompt_tokens` are cached (see the module docstring).
        """
        index = self._requests.pop(request_id, None)
        cap = self.config.suffix_decoding_max_cached_requests
        if cap == 0:
            return
        if token_ids is not None:
            tokens = _as_list(token_ids[num_prompt_tokens:])
        elif index is not None:
            tokens = index.tokens[num_prompt_tokens:]
        else:
            return
        if not tokens:
            return
        while len(self._cached) >= cap:
            self._global.remove(self._cached.pop(next(iter(self._cached))))
        self._cached[self._serial] = tokens
        self._serial += 1
        self._global.extend(tokens, 0, [])

    def _sync(self, request_id: str, token_ids: Sequence[int]) -> _RequestIndex:
        index = self._requests.get(request_id)
        n = len(token_ids)
        seen = 0
        if index is not None:
            tokens = index.tokens
            seen = len(tokens)
            if n < seen or (
                seen and (token_ids[seen - 1] != tokens[seen - 1] or token_ids[0] != tokens[0])
            ):
                index, seen = None, 0
        if index is None:
            index = self._requests[request_id] = _RequestIndex(self.depth)
        if n > seen:
            index.tokens.extend(_as_list(token_ids[seen:]))
            index.frontier = index.trie.extend(index.tokens, seen, index.frontier)
        return index

    def _cap(self, limit: int, match: int) -> int:
        return min(limit, int(match * self.config.suffix_decoding_max_spec_factor + 1e-6))

    def _match_order(self, longest: int, limit: int) -> list[int]:
        """Match lengths to try: the longest that leaves depth for `limit` drafts first (the
        likely winner, after which the rest are quickly ruled out), then the longer ones, then
        the shorter ones."""
        first = max(1, min(longest, self.depth - limit))
        return [*range(first, longest + 1), *range(first - 1, 0, -1)]

    def _propose_global(
        self, tokens: list[int], limit: int, score: float
    ) -> tuple[list[int], float]:
        """The best draft from the cache if it scores above `score`, else nothing."""
        # The suffixes seen with a continuation are exactly those up to some length: find it.
        n = len(tokens)
        lo, hi = 0, min(n, self.depth - 1)
        where: _Node | list[int] | None = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            spot = self._global.locate(tokens, n - mid)
            if spot is None:
                hi = mid - 1
            else:
                lo, where = mid, spot
        drafts: list[int] = []
        for match in self._match_order(lo, limit):
            cap = self._cap(limit, match)
            if min(cap, self.depth - match) <= score:
                continue
            at = where if match == lo else self._global.locate(tokens, n - match)
            assert at is not None
            if isinstance(at, list):  # a single earlier occurrence: probability 1
                found, found_score = at[:cap], float(min(cap, len(at)))
            else:
                found, found_score = self._follow(at, match, cap, 0)
            if found_score > score:
                drafts, score = found, found_score
        return drafts, score

    def _follow(self, node: _Node, depth: int, cap: int, discount: int) -> tuple[list[int], float]:
        """Up to `cap` tokens along the most frequent children of `node` (at `depth`) while
        the path probability stays at least the minimum, and their score. `discount`: the
        occurrences counted at `node` that have no continuation to learn from."""
        min_prob = self.config.suffix_decoding_min_token_prob
        drafts: list[int] = []
        prob = 1.0
        score = 0.0
        while len(drafts) < cap:
            children = node.children
            if not children:
                break
            key = node.best
            if key is None:
                key = _rescan(node)
            child = children[key]
            prob *= child.count / (node.count - discount)
            discount = 0
            if prob < min_prob:
                break
            drafts.append(key)
            score += prob
            depth += 1
            if type(child) is _Leaf:
                seq, origin = child.seq, child.origin
                at = origin + depth
                end = min(origin + self.depth, len(seq), at + cap - len(drafts))
                if at < end:
                    drafts += seq[at:end]
                    score += prob * (end - at)
                break
            node = child
        return drafts, score


def _as_list(tokens: Sequence[int]) -> list[int]:
    return tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
